"""xFormers' ``merge_attentions`` with xFormers' layouts: chunk-major, natural-log LSE, heads after tokens.

=================  ====================================================  ===============================
argument           xFormers' layout                                      the core's (what is passed to it)
=================  ====================================================  ===============================
``attn_split``     ``[num_chunks, B, M, G, H, Kq]`` or ``[num_chunks, B,   ``[num_chunks, B * M, G * H, Kq]``
                   M, H, Kq]``, or a sequence of ``[B, M, (G,) H, Kq]``  where the strides fold, else per
                                                                         batch element (views)
``lse_split``      ``[num_chunks, B, G, H, M]`` or ``[num_chunks, B, H,   ``[num_chunks, G * H, B * M]``
                   M]``, or a sequence of ``[B, (G,) H, M]``             (views)
returned ``attn``  ``[B, M, (G,) H, Kq]``, C-contiguous                  the same
returned ``lse``   ``[B, (G,) H, M]``, C-contiguous                      ``[B, G * H, M]``
=================  ====================================================  ===============================

Accepted beyond xFormers: any head size and number of chunks, float16 and bfloat16 partials,
any strides with a contiguous last dimension, torch tensors and CuPy arrays, a keyword-only
``stream=``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from .._options import value_dtype_name
from ..types import Array, Stream
from . import (
    cast,
    dims,
    dtype_of,
    element_strides,
    empty,
    expect_flag,
    expect_like,
    expect_values,
    fold,
    is_torch,
    lse_input,
    merge_batched,
    permute,
    refuse_grad,
    shape_of,
    take,
)

STACKED = "[num_chunks, B, M, (G,) H, Kq]"
CHUNK = "[B, M, (G,) H, Kq]"
STACKED_LSE = "[num_chunks, B, (G,) H, M]"
CHUNK_LSE = "[B, (G,) H, M]"
CONVENTION = "xFormers' chunk-major partials"
LSE_CONVENTION = "xFormers' natural-log LSE, [B, (G,) H, M] a chunk"


def merge_attentions(
    attn_split: Array | Sequence[Array],
    lse_split: Array | Sequence[Array],
    write_lse: bool = True,
    output_dtype: Any = None,
    *,
    stream: Stream = None,
) -> tuple[Array, Array | None]:
    """Merge attention computed over chunks of the keys (xFormers' ``fmha.merge_attentions``).

    ``lse = log(sum_i exp(lse_split[i]))``, ``attn = sum_i exp(lse_split[i] - lse) * attn_split[i]``
    over the chunks ``i``, per batch element, query, head group and head.

    Parameters
    ----------
    attn_split : torch.Tensor or cupy.ndarray, or a sequence of them
        ``[num_chunks, B, M, G, H, Kq]`` or ``[num_chunks, B, M, H, Kq]``, or a sequence of
        ``num_chunks`` arrays ``[B, M, (G,) H, Kq]``; float32, float16 or bfloat16; any strides
        with a contiguous last dimension.
    lse_split : torch.Tensor or cupy.ndarray, or a sequence of them
        ``[num_chunks, B, G, H, M]`` or ``[num_chunks, B, H, M]``, or a sequence of ``[B, (G,) H,
        M]``; natural log, float32 (float16, bfloat16 or float64 are cast to a float32 copy); any
        strides. A chunk whose LSE is ``-inf`` contributes nothing, even if its values are NaN.
    write_lse : bool
        Whether to return the merged LSE (it is computed either way).
    output_dtype : torch.dtype or str, optional
        Dtype of the merged values; ``attn_split``'s by default.
    stream : Stream, optional
        Where to launch (cupy-merge's extension; by default the current stream of the arrays' kind).

    Returns
    -------
    attn : torch.Tensor or cupy.ndarray
        ``[B, M, (G,) H, Kq]``, C-contiguous, of ``output_dtype``.
    lse : torch.Tensor or cupy.ndarray or None
        ``[B, (G,) H, M]``, C-contiguous, of ``lse_split``'s dtype (computed in float32); None if
        ``write_lse`` is False.

    Raises
    ------
    TypeError
        A dtype or array kind xFormers' layout does not allow; the message names the argument.
    RuntimeError
        An input that requires grad, in grad mode (xFormers' merge has no backward either;
        ``cupy_merge.merge_states`` has one); the message names the argument.
    ValueError
        A shape that is not xFormers' layout, or no chunks in a sequence; the message names the
        argument and the layout.

    See Also
    --------
    cupy_merge.merge_states : The core merge, with the LSE ``[num_chunks, heads, tokens]``.

    Notes
    -----
    The core merge has one token axis and one head axis, each with one stride. Where the strides
    allow, ``B`` and ``M`` fold into the tokens and ``G`` and ``H`` into the heads: **one** core
    merge on views (C-contiguous inputs with ``B == 1`` or ``M == 1``, the decoding case, fold);
    otherwise one core merge per batch element or query position, still on views. A sequence of
    chunks that are views of one buffer at equal distances (``torch.unbind`` of a stacked tensor,
    the same tensor twice) is read in place; any other sequence of more than one chunk is stacked
    first, a copy: pass a stacked tensor to avoid it. Queries whose chunks are all ``-inf`` give
    0 and ``-inf``, as in xFormers; ``+inf`` is read as ``-inf`` (xFormers: NaN).

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat.xformers import merge_attentions
    >>> attn = torch.randn(4, 1, 300, 2, 8, 128, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
    >>> lse = torch.randn(4, 1, 2, 8, 300, device="cuda")                          # doctest: +SKIP
    >>> out, out_lse = merge_attentions(attn, lse)                                 # doctest: +SKIP
    >>> out.shape, out_lse.shape                                                   # doctest: +SKIP
    (torch.Size([1, 300, 2, 8, 128]), torch.Size([1, 2, 8, 300]))
    """
    expect_flag(write_lse, "write_lse")
    values, adapter = _stacked(attn_split, "attn_split", STACKED, CHUNK)
    shape = shape_of(values)
    if len(shape) not in (5, 6):
        raise ValueError(
            f"attn_split: expected a 6-D array [num_chunks, B, M, G, H, Kq] or a 5-D array [num_chunks, B, M, H, "
            f"Kq] (or a sequence of {CHUNK}), got shape {dims(shape)}"
        )
    expect_values(values, "attn_split", len(shape), STACKED, CONVENTION)
    grouped = len(shape) == 6
    num_chunks, batch, queries, *groups_heads, _ = shape
    lse_shape = (num_chunks, batch, *groups_heads, queries)
    lses = _stacked(lse_split, "lse_split", STACKED_LSE, CHUNK_LSE)[0]
    lse_dtype = dtype_of(lses)
    lses = lse_input(lses, "lse_split", lse_shape, STACKED_LSE, "attn_split", LSE_CONVENTION, castable=True)
    dtype = dtype_of(values) if output_dtype is None else value_dtype_name(output_dtype, "output_dtype")
    refuse_grad((("attn_split", values), ("lse_split", lses)), "merge_states")
    attn = empty(values, adapter, shape[1:], dtype, stream)
    lse = empty(values, adapter, lse_shape[1:], "float32", stream)
    if not grouped:
        merge_batched(values, permute(lses, 0, 1, 3, 2), attn, lse, stream)
    else:
        _merge_grouped(values, lses, attn, lse, stream)
    if not write_lse:
        return attn, None
    return attn, (lse if lse_dtype == "float32" else cast(lse, lse_dtype))  # xFormers returns lse_split's dtype


def _merge_grouped(values: Any, lses: Any, attn: Any, lse: Any, stream: Stream) -> None:
    """``values`` [N, B, M, G, H, K] and ``lses`` [N, B, G, H, M] into ``attn`` [B, M, G, H, K] and
    ``lse`` [B, G, H, M]: G and H folded into one head axis where every array's strides allow it,
    else one merge per head group."""
    folded = (fold(values, 3), fold(lses, 2), fold(attn, 2), fold(lse, 1))
    if all(view is not None for view in folded):
        values_heads, lses_heads, attn_heads, lse_heads = folded
        merge_batched(values_heads, permute(lses_heads, 0, 1, 3, 2), attn_heads, lse_heads, stream)
        return
    for group in range(shape_of(values)[3]):
        merge_batched(
            values[:, :, :, group], permute(lses[:, :, group], 0, 1, 3, 2), attn[:, :, group], lse[:, group], stream
        )


def _stacked(chunks: Any, name: str, layout: str, chunk_layout: str) -> tuple[Any, Any]:
    """``chunks`` as one array ``[num_chunks, ...]`` and its adapter: an array as it is; a sequence as a
    view where its arrays lie at equal distances in one buffer (or there is one), else stacked (a copy)."""
    if not isinstance(chunks, (list, tuple)):
        return take(chunks, name)
    if not chunks:
        raise ValueError(f"{name}: expected at least one chunk {chunk_layout}, got an empty sequence")
    first, adapter = take(chunks[0], f"{name}[0]")
    arrays = [first]
    for index, chunk in enumerate(chunks[1:], 1):
        array, kind = take(chunk, f"{name}[{index}]")
        if kind is not adapter:
            raise TypeError(f"{name}[{index}]: expected an array of the kind of {name}[0] ({adapter.kind})")
        expect_like(array, first, f"{name}[{index}]", f"{name}[0]")
        arrays.append(array)
    # Each chunk by its own name: a view of the stack is made from the first chunk alone.
    refuse_grad(((f"{name}[{index}]", array) for index, array in enumerate(arrays)), "merge_states")
    view = _view_of_stack(arrays, adapter)
    return (_stack(arrays) if view is None else view), adapter


def _view_of_stack(arrays: list, adapter: Any) -> Any | None:
    """The arrays as one ``[len(arrays), ...]`` view where they are alike views of one buffer at a
    constant distance (0 too: one array twice), else None."""
    first = arrays[0]
    strides = element_strides(first)
    if strides is None:
        return None
    if is_torch(first) and (_compiling() or any(array.is_neg() or array.is_conj() for array in arrays)):
        return None  # a traced tensor has no address; a negated or conjugate view is not its memory
    try:
        pointers = [adapter.pointer(array) for array in arrays]
    except RuntimeError:  # a fake tensor (torch.export, make_fx)
        return None
    itemsize = _itemsize(first)
    step = (pointers[1] - pointers[0]) if len(arrays) > 1 else 0
    if step < 0 or step % itemsize or any(b - a != step for a, b in itertools.pairwise(pointers)):
        return None
    if any(element_strides(array) != strides or not _same_buffer(array, first) for array in arrays[1:]):
        return None
    shape, new_strides = (len(arrays), *shape_of(first)), (step // itemsize, *strides)
    if is_torch(first):
        try:
            return first.as_strided(shape, new_strides)
        except RuntimeError:  # out of the first chunk's storage: another storage at the same address
            return None
    import cupy

    return cupy.lib.stride_tricks.as_strided(first, shape=shape, strides=tuple(s * itemsize for s in new_strides))


def _compiling() -> bool:
    import torch

    return bool(torch.compiler.is_compiling())


def _itemsize(array: Any) -> int:
    return int(array.element_size()) if is_torch(array) else int(array.itemsize)


def _same_buffer(array: Any, first: Any) -> bool:
    """Whether ``array`` lies in ``first``'s allocation (a view at another place in it is then in bounds)."""
    if is_torch(array):
        return bool(array.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
    return bool(array.data.mem is first.data.mem)


def _stack(arrays: list) -> Any:
    if is_torch(arrays[0]):
        import torch

        return torch.stack(arrays)
    import cupy

    return cupy.stack(arrays)


__all__ = ["merge_attentions"]
