"""FlashInfer's merges with FlashInfer's signatures and layouts: token-major, **base-2** LSEs.

=============  =================================================  =====================================
argument       FlashInfer's layout                                the core's (what is passed to it)
=============  =================================================  =====================================
values         ``[seq_len, num_heads, head_dim]``                 the same
LSE            ``[seq_len, num_heads]``, float32, base 2          ``s.T``: ``[num_heads, seq_len]``
N-way values   ``[seq_len, num_states, num_heads, head_dim]``     ``v.transpose(0, 1)``
N-way LSE      ``[seq_len, num_states, num_heads]``               ``s.permute(1, 2, 0)``
=============  =================================================  =====================================

Every call passes ``lse_base=2`` and zero-copy views; the merged LSE is allocated as FlashInfer
returns it (C-contiguous ``[seq_len, num_heads]``) and written through its transpose.

The trap this module closes: the core's LSE is ``[num_heads, num_tokens]`` in natural log, so
FlashInfer's token-major tensor handed to :func:`cupy_merge.merge_state` unchanged is refused
only when ``seq_len != num_heads``; where they are equal it is read transposed, and a base-2 LSE
read as natural log weighs every state wrongly. Here the arguments mean what they mean in
FlashInfer, whatever their extents.

Accepted beyond FlashInfer: float32 values (FlashInfer: float16 and bfloat16 only), any head_dim
(FlashInfer: 64, 128, 256, 512), any number of heads (FlashInfer's CUDA kernels fail to launch
past 1024 threads a block), any strides with a contiguous last dimension (FlashInfer: contiguous
only), torch tensors and CuPy arrays, a keyword-only ``stream=``. Refused where FlashInfer
misbehaves: ``v_b`` of another dtype than ``v_a`` (FlashInfer reinterprets its bytes), a mask
wider than a byte (FlashInfer's CUDA kernel reads its bytes one by one; bool, uint8 and int8
masks are read as it reads them, nonzero merging), a non-float32 ``s`` in
:func:`merge_state_in_place` (FlashInfer updates a float32 copy and loses the update).
"""

from __future__ import annotations

from .. import _ops
from ..types import Array, Stream
from . import expect_flag
from ._peer import Arg, PeerMerge

VALUES = ("seq_len", "num_heads", "head_dim")
LSE = ("seq_len", "num_heads")
CONVENTION = "FlashInfer's token-major, base-2 LSE"
SWAPPED = (
    "that is cupy_merge's [num_heads, num_tokens] layout: FlashInfer's LSE is token-major, pass it "
    "as FlashInfer takes it (or call the core merge with lse_base=2)"
)
_RESULTS = (Arg("V", "out", VALUES), Arg("S", "out_lse", LSE))


def _peer(operation: _ops.Operation, *arguments: Arg, results: tuple[Arg, ...] = _RESULTS) -> PeerMerge:
    return PeerMerge(operation, arguments, results, "FlashInfer's layout", CONVENTION, SWAPPED)


_MERGE_STATE = _peer(
    _ops.MERGE_STATE, Arg("v_a", "v_a", VALUES), Arg("v_b", "v_b", VALUES), Arg("s_a", "s_a", LSE), Arg("s_b", "s_b", LSE)
)
_MERGE_STATE_IN_PLACE = _peer(
    _ops.MERGE_STATE_IN_PLACE, Arg("v", "v_a", VALUES), Arg("v_other", "v_b", VALUES),
    Arg("s", "s_a", LSE, castable=False, note=(
        "; FlashInfer's merge_state_in_place would update a float32 copy of it and lose the update: keep the LSE "
        "in float32")),
    Arg("s_other", "s_b", LSE), Arg("mask", "mask", ("seq_len",), note="FlashInfer's CUDA kernel reads a wider "
                                                                        "dtype's bytes one by one: pass mask != 0"),
    results=(),
)  # fmt: skip
_MERGE_STATES = _peer(
    _ops.MERGE_STATES, Arg("v", "v", ("seq_len", "num_states", "num_heads", "head_dim")),
    Arg("s", "s", ("seq_len", "num_states", "num_heads")),
)  # fmt: skip
_VARIABLE_LENGTH = _peer(
    _ops.MERGE_STATES_VARLEN, Arg("v", "v", ("total_num_states", "num_heads", "head_dim")),
    Arg("s", "s", ("total_num_states", "num_heads")), Arg("indptr", "indptr", ("seq_len + 1",)),
)  # fmt: skip


def merge_state(
    v_a: Array, s_a: Array, v_b: Array, s_b: Array, *, stream: Stream = None
) -> tuple[Array, Array]:
    """Merge two attention states (FlashInfer's ``flashinfer.merge_state``): token-major, base-2 LSE.

    ``V = (2**s_a * v_a + 2**s_b * v_b) / (2**s_a + 2**s_b)``, ``S = log2(2**s_a + 2**s_b)``,
    per token and head.

    Parameters
    ----------
    v_a : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32; any strides with a
        contiguous last dimension.
    s_a : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]`` (token-major), **base-2** log-sum-exp of ``v_a``'s scores,
        float32 (float16, bfloat16 or float64 are cast to a float32 copy, as FlashInfer does).
    v_b : torch.Tensor or cupy.ndarray
        Like ``v_a``, of its shape and dtype.
    s_b : torch.Tensor or cupy.ndarray
        Like ``s_a``.
    stream : Stream, optional
        Where to launch (cupy-merge's extension; by default the current stream of the arrays'
        kind, as FlashInfer).

    Returns
    -------
    V : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, dtype of ``v_a``, C-contiguous.
    S : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]``, float32, base 2, C-contiguous. Both of ``v_a``'s array kind.

    Raises
    ------
    TypeError
        A dtype or array kind FlashInfer's layout does not allow; the message names the argument.
    ValueError
        A shape that is not FlashInfer's layout; the message names the argument and the layout.

    Warnings
    --------
    ``s_a`` and ``s_b`` are FlashInfer's ``[seq_len, num_heads]`` and base 2, whatever the extents:
    with ``seq_len == num_heads`` a ``[num_heads, seq_len]`` tensor (the core's layout) cannot be
    told apart by its shape and is read as token-major.

    See Also
    --------
    cupy_merge.merge_state : The core merge: ``merge_state(v_a, s_a.T, v_b, s_b.T, lse_base=2)``.

    Notes
    -----
    Calls ``cupy_merge.merge_state(v_a, s_a.T, v_b, s_b.T, out=V, out_lse=S.T, lse_base=2)``:
    views, no copy. Two empty states (both LSEs ``-inf``) give 0 and ``-inf`` (FlashInfer's main
    branch; its releases up to 0.6.18rc7 give NaN); ``+inf`` is read as ``-inf`` (FlashInfer's
    CUDA kernel: values 0 and LSE NaN; its Triton kernels: NaN).

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import flashinfer
    >>> va = torch.randn(2048, 32, 128, device="cuda").half()                      # doctest: +SKIP
    >>> vb = torch.randn(2048, 32, 128, device="cuda").half()                      # doctest: +SKIP
    >>> sa = torch.randn(2048, 32, device="cuda")                                  # doctest: +SKIP
    >>> sb = torch.randn(2048, 32, device="cuda")                                  # doctest: +SKIP
    >>> V, S = flashinfer.merge_state(va, sa, vb, sb)                              # doctest: +SKIP
    >>> V.shape, S.shape, S.dtype                                                  # doctest: +SKIP
    (torch.Size([2048, 32, 128]), torch.Size([2048, 32]), torch.float32)
    """
    return _MERGE_STATE({"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b}, stream, lse_base=2)  # type: ignore[return-value]


def merge_state_in_place(
    v: Array, s: Array, v_other: Array, s_other: Array, mask: Array | None = None, *, stream: Stream = None
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (FlashInfer's ``flashinfer.merge_state_in_place``).

    Parameters
    ----------
    v : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32, updated in place.
    s : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]`` (token-major), **base-2** log-sum-exp, float32 (required: FlashInfer
        casts another dtype to a copy and silently loses the update; refused here), updated in place.
    v_other : torch.Tensor or cupy.ndarray
        Like ``v``, of its shape and dtype.
    s_other : torch.Tensor or cupy.ndarray
        Like ``s``; float16, bfloat16 or float64 are cast to a float32 copy, as FlashInfer does.
    mask : torch.Tensor or cupy.ndarray, optional
        Bool, uint8 or int8 ``[seq_len]``: tokens where it is False (zero) are neither read nor
        written (one CUDA graph for batches where only some tokens have a second state); a byte
        mask is read as FlashInfer's CUDA kernel reads it, nonzero merging (a bool view, no
        copy). Wider dtypes are refused (FlashInfer's CUDA kernel reads their bytes one by one):
        pass ``mask != 0``.
    stream : Stream, optional
        Where to launch (cupy-merge's extension).

    Returns
    -------
    None
        The result is in ``v`` and ``s``.

    Raises
    ------
    TypeError
        A dtype or array kind FlashInfer's layout does not allow; the message names the argument.
    ValueError
        A shape that is not FlashInfer's layout; the message names the argument and the layout.

    Warnings
    --------
    ``s`` and ``s_other`` are FlashInfer's ``[seq_len, num_heads]`` and base 2, whatever the
    extents: with ``seq_len == num_heads`` the shape cannot tell a transposed tensor apart.

    See Also
    --------
    cupy_merge.merge_state_in_place : The core merge, with ``s.T`` and ``lse_base=2``.

    Notes
    -----
    Calls ``cupy_merge.merge_state_in_place(v, s.T, v_other, s_other.T, mask, lse_base=2)``.

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import flashinfer
    >>> v = torch.randn(512, 32, 128, device="cuda").half()                        # doctest: +SKIP
    >>> s = torch.randn(512, 32, device="cuda")                                    # doctest: +SKIP
    >>> v_other, s_other = torch.randn_like(v), torch.randn_like(s)                # doctest: +SKIP
    >>> mask = torch.rand(512, device="cuda") > 0.5                                # doctest: +SKIP
    >>> flashinfer.merge_state_in_place(v, s, v_other, s_other, mask)              # doctest: +SKIP
    """
    given = {"v": v, "s": s, "v_other": v_other, "s_other": s_other, "mask": mask}
    _MERGE_STATE_IN_PLACE(given, stream, lse_base=2)


def merge_states(v: Array, s: Array, *, stream: Stream = None) -> tuple[Array, Array]:
    """Merge ``num_states`` attention states of each token in one pass (FlashInfer's ``flashinfer.merge_states``).

    Parameters
    ----------
    v : torch.Tensor or cupy.ndarray
        ``[seq_len, num_states, num_heads, head_dim]`` (token-major), float16, bfloat16 or float32;
        any strides with a contiguous last dimension.
    s : torch.Tensor or cupy.ndarray
        ``[seq_len, num_states, num_heads]``, **base-2** log-sum-exp, float32 (float16, bfloat16 or
        float64 are cast to a float32 copy, as FlashInfer does).
    stream : Stream, optional
        Where to launch (cupy-merge's extension).

    Returns
    -------
    V : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, dtype of ``v``; a token whose states are all empty
        (``-inf``), or with ``num_states == 0``, gets 0.
    S : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]``, float32, base 2; ``-inf`` for such a token (FlashInfer's main
        branch; its releases up to 0.6.18rc7 give the sentinel ``-5e4``). With one state a token
        that state is merged like any other, an empty one giving 0 and ``-inf``; FlashInfer's
        kernel for fewer states than tokens copies it unchanged instead, an empty state's values
        and a ``+inf`` LSE included.

    Raises
    ------
    TypeError
        A dtype or array kind FlashInfer's layout does not allow; the message names the argument.
    ValueError
        A shape that is not FlashInfer's layout; the message names the argument and the layout.

    Warnings
    --------
    The layout is token-major, unlike :func:`cupy_merge.merge_states`'
    ``[num_states, num_tokens, ...]`` and ``[num_states, num_heads, num_tokens]``.

    See Also
    --------
    cupy_merge.merge_states : The core merge, with ``v.transpose(0, 1)``, ``s.permute(1, 2, 0)``.

    Notes
    -----
    Calls ``cupy_merge.merge_states(v.transpose(0, 1), s.permute(1, 2, 0), out=V, out_lse=S.T,
    lse_base=2)``: views, no copy.

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import flashinfer
    >>> v = torch.randn(2048, 100, 32, 128, device="cuda").half()                  # doctest: +SKIP
    >>> s = torch.randn(2048, 100, 32, device="cuda")                              # doctest: +SKIP
    >>> V, S = flashinfer.merge_states(v, s)                                       # doctest: +SKIP
    >>> V.shape, S.shape                                                           # doctest: +SKIP
    (torch.Size([2048, 32, 128]), torch.Size([2048, 32]))
    """
    return _MERGE_STATES({"v": v, "s": s}, stream, lse_base=2)  # type: ignore[return-value]


def variable_length_merge_states(
    v: Array, s: Array, indptr: Array, *, check_indptr: bool = False, stream: Stream = None
) -> tuple[Array, Array]:
    """Merge a ragged batch (FlashInfer's ``flashinfer.triton.cascade.variable_length_merge_states``).

    Token ``t`` merges rows ``indptr[t]:indptr[t + 1]`` of ``v`` and ``s``.

    Parameters
    ----------
    v : torch.Tensor or cupy.ndarray
        ``[total_num_states, num_heads, head_dim]``: every token's states, back to back;
        float16, bfloat16 or float32, any strides with a contiguous last dimension.
    s : torch.Tensor or cupy.ndarray
        ``[total_num_states, num_heads]`` (token-major), **base-2** log-sum-exp, float32
        (float16, bfloat16 or float64 are cast to a float32 copy, as FlashInfer does).
    indptr : torch.Tensor or cupy.ndarray
        ``[seq_len + 1]`` on the device: non-decreasing offsets starting at 0; int32 or int64,
        used as they are (FlashInfer casts every dtype with ``.to(torch.int32)``, wrapping int64
        offsets past 2**31); narrower integers are cast to an int32 copy; floats are refused.
    check_indptr : bool, optional
        Copy ``indptr`` to the host and check it first (cupy-merge's extension: a synchronisation).
        False by default, as FlashInfer checks nothing: a token whose offsets are out of range then
        comes out NaN, never an out-of-bounds read. Works inside CUDA graphs.
    stream : Stream, optional
        Where to launch (cupy-merge's extension).

    Returns
    -------
    V : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, dtype of ``v``; a token with no rows gets 0.
    S : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]``, float32, base 2; ``-inf`` for a token with no rows (FlashInfer's
        Triton kernel: the sentinel ``-5e4``, which its phantom starting state also gives a token
        whose LSEs all lie below about ``-5e4``).

    Raises
    ------
    TypeError
        A dtype or array kind FlashInfer's layout does not allow; the message names the argument.
    ValueError
        A shape that is not FlashInfer's layout; the message names the argument and the layout.

    Warnings
    --------
    ``s`` is FlashInfer's token-major ``[total_num_states, num_heads]`` and base 2.

    See Also
    --------
    cupy_merge.merge_states_varlen : The core merge, with ``s.T`` and ``lse_base=2``.

    Notes
    -----
    Calls ``cupy_merge.merge_states_varlen(v, s.T, indptr, out=V, out_lse=S.T, lse_base=2,
    check_indptr=check_indptr)``: views, no copy. FlashInfer's Triton version runs on SM 9.x
    only; this one on every GPU cupy-merge supports.

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import flashinfer
    >>> lengths = torch.randint(1, 512, (2048,))                                   # doctest: +SKIP
    >>> indptr = torch.cat([torch.zeros(1), lengths.cumsum(0)]).int().cuda()       # doctest: +SKIP
    >>> v = torch.randn(int(lengths.sum()), 32, 128, device="cuda").half()         # doctest: +SKIP
    >>> s = torch.randn(int(lengths.sum()), 32, device="cuda")                     # doctest: +SKIP
    >>> V, S = flashinfer.variable_length_merge_states(v, s, indptr)               # doctest: +SKIP
    >>> V.shape, S.shape                                                           # doctest: +SKIP
    (torch.Size([2048, 32, 128]), torch.Size([2048, 32]))
    """
    expect_flag(check_indptr, "check_indptr")
    given = {"v": v, "s": s, "indptr": indptr}
    return _VARIABLE_LENGTH(given, stream, lse_base=2, check_indptr=check_indptr)  # type: ignore[return-value]


__all__ = ["merge_state", "merge_state_in_place", "merge_states", "variable_length_merge_states"]
