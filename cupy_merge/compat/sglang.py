"""SGLang's ``merge_state_v2`` and ``merge_state`` with SGLang's signatures and layout: token-major, natural-log LSE.

=========  ========================================  ==================================
argument   SGLang's layout                           the core's (what is passed to it)
=========  ========================================  ==================================
values     ``[seq_len, num_heads, head_dim]``        the same
LSE        ``[seq_len, num_heads]``, float32, ln     ``s.T``: ``[num_heads, seq_len]``
=========  ========================================  ==================================

SGLang has three functions called "merge_state", and their LSE bases differ:

* ``sgl_kernel.merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None)``: natural
  log. Use :func:`merge_state_v2`.
* ``sglang.srt.layers.attention.merge_state.merge_state(prefix_output, prefix_lse,
  suffix_output, suffix_lse, output=None, output_lse=None)``, the dispatcher over
  ``merge_state_v2`` and a Triton kernel: natural log, the same arguments in the same places
  under other names. Use :func:`merge_state` (this module's is this one).
* ``sgl_kernel.merge_state(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None)`` ("v1", FlashInfer's
  kernel vendored): **base 2**. Use :func:`merge_state_v2` with ``lse_base=2``, or
  :func:`cupy_merge.compat.flashinfer.merge_state` where no outputs are given, not this
  module's :func:`merge_state`: reading its base-2 LSEs as natural logs weighs every state
  wrongly, without any error.
"""

from __future__ import annotations

from .. import _ops
from ..types import Array, LseBase, Stream
from . import expect_flag
from ._peer import Arg, PeerMerge

VALUES = ("seq_len", "num_heads", "head_dim")
LSE = ("seq_len", "num_heads")
_MERGE_STATE_V2 = PeerMerge(
    _ops.MERGE_STATE,
    (Arg("v_a", "v_a", VALUES), Arg("v_b", "v_b", VALUES), Arg("s_a", "s_a", LSE), Arg("s_b", "s_b", LSE)),
    (Arg("v_merged", "out", VALUES), Arg("s_merged", "out_lse", LSE)),
    "SGLang's layout",
    "SGLang's token-major LSE, natural log",
    "that is cupy_merge's [num_heads, num_tokens] layout: SGLang's LSE is token-major, pass it as SGLang takes it "
    "(or call cupy_merge.merge_state)",
)


_MERGE_STATE = PeerMerge(
    _ops.MERGE_STATE,
    (Arg("prefix_output", "v_a", VALUES), Arg("suffix_output", "v_b", VALUES), Arg("prefix_lse", "s_a", LSE),
     Arg("suffix_lse", "s_b", LSE)),
    (Arg("output", "out", VALUES), Arg("output_lse", "out_lse", LSE)),
    _MERGE_STATE_V2.values_convention,
    _MERGE_STATE_V2.convention,
    _MERGE_STATE_V2.swapped,
)  # fmt: skip


def merge_state_v2(
    v_a: Array,
    s_a: Array,
    v_b: Array,
    s_b: Array,
    v_merged: Array | None = None,
    s_merged: Array | None = None,
    *,
    enable_pdl: bool | None = None,
    lse_base: LseBase = "e",
    stream: Stream = None,
) -> tuple[Array, Array]:
    """Merge two attention states (SGLang's ``sgl_kernel.merge_state_v2``): token-major, natural-log LSE.

    ``v_merged = (exp(s_a) * v_a + exp(s_b) * v_b) / (exp(s_a) + exp(s_b))``,
    ``s_merged = log(exp(s_a) + exp(s_b))``, per token and head.

    Parameters
    ----------
    v_a : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32; any strides with a
        contiguous last dimension.
    s_a : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]`` (token-major), natural-log log-sum-exp of ``v_a``'s scores,
        float32 (float16, bfloat16 or float64 are cast to a float32 copy, as SGLang does).
        ``+inf`` is read as ``-inf``, as SGLang does.
    v_b : torch.Tensor or cupy.ndarray
        Like ``v_a``, of its shape and dtype.
    s_b : torch.Tensor or cupy.ndarray
        Like ``s_a``.
    v_merged : torch.Tensor or cupy.ndarray, optional
        ``[seq_len, num_heads, head_dim]`` to write the merged values into, float16, bfloat16 or
        float32 (converted from the inputs' dtype; SGLang reinterprets the inputs as
        ``v_merged``'s dtype instead); may be ``v_a`` or ``v_b`` itself. Allocated like ``v_a``
        if omitted.
    s_merged : torch.Tensor or cupy.ndarray, optional
        ``[seq_len, num_heads]`` float32 to write the merged LSE into; may be ``s_a`` or ``s_b``
        itself (safe here; racy in SGLang's kernel). Allocated if omitted.
    enable_pdl : bool, optional
        Keyword only, accepted and ignored: a switch for programmatic dependent launch
        (overlapping a kernel's start with the previous kernel's end on Hopper), a scheduling
        choice that does not change the result; cupy-merge's kernels launch without it.
        ``sgl_kernel.merge_state_v2`` itself takes no such argument.
    lse_base : {"e", 2}
        cupy-merge's extension: 2 for the base-2 LSEs of ``sgl_kernel.merge_state`` (v1,
        FlashInfer's kernel), which takes the same arguments.
    stream : Stream, optional
        Where to launch (cupy-merge's extension; by default the current stream of the arrays'
        kind, as SGLang).

    Returns
    -------
    v_merged : torch.Tensor or cupy.ndarray
        The merged values: the given ``v_merged`` or a new C-contiguous array of ``v_a``'s dtype.
    s_merged : torch.Tensor or cupy.ndarray
        The merged LSE, ``[seq_len, num_heads]`` float32: the given ``s_merged`` or a new
        C-contiguous array. New arrays are of ``v_a``'s array kind.

    Raises
    ------
    TypeError
        A dtype or array kind SGLang's layout does not allow; the message names the argument.
    ValueError
        A shape that is not SGLang's layout; the message names the argument and the layout.

    Warnings
    --------
    ``s_a``, ``s_b`` and ``s_merged`` are SGLang's ``[seq_len, num_heads]``, whatever the extents:
    with ``seq_len == num_heads`` a ``[num_heads, seq_len]`` tensor (the core's and vLLM's layout)
    cannot be told apart by its shape and is read as token-major.

    See Also
    --------
    cupy_merge.merge_state : The core merge: ``merge_state(v_a, s_a.T, v_b, s_b.T)``.

    Notes
    -----
    Calls ``cupy_merge.merge_state(v_a, s_a.T, v_b, s_b.T, out=v_merged, out_lse=s_merged.T)``:
    views, no copy. Where both LSEs are ``-inf`` the result is 0 and ``-inf`` (SGLang: NaN).
    Head sizes need not be multiples of 4 (float32) or 8 (16-bit), as SGLang's CUDA kernel requires.

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import sglang
    >>> v_a = torch.randn(613, 32, 128, device="cuda").half()                      # doctest: +SKIP
    >>> v_b = torch.randn(613, 32, 128, device="cuda").half()                      # doctest: +SKIP
    >>> s_a = torch.randn(613, 32, device="cuda")                                  # doctest: +SKIP
    >>> s_b = torch.randn(613, 32, device="cuda")                                  # doctest: +SKIP
    >>> v, s = sglang.merge_state_v2(v_a, s_a, v_b, s_b)                           # doctest: +SKIP
    >>> v, s = sglang.merge_state_v2(v_a, s_a, v_b, s_b, v_a, s_a)  # in place     # doctest: +SKIP
    """
    expect_flag(enable_pdl, "enable_pdl", none=True)
    convention = "SGLang's token-major LSE, base 2" if lse_base == 2 else ""
    given = {"v_a": v_a, "s_a": s_a, "v_b": v_b, "s_b": s_b, "v_merged": v_merged, "s_merged": s_merged}
    return _MERGE_STATE_V2(given, stream, convention, lse_base=lse_base)  # type: ignore[return-value]


def merge_state(
    prefix_output: Array,
    prefix_lse: Array,
    suffix_output: Array,
    suffix_lse: Array,
    output: Array | None = None,
    output_lse: Array | None = None,
    *,
    stream: Stream = None,
) -> tuple[Array, Array]:
    """Merge a prefix's and a suffix's attention states (SGLang's
    ``sglang.srt.layers.attention.merge_state.merge_state``): token-major, natural-log LSE.

    :func:`merge_state_v2` under the names SGLang's serving code calls it by (its dispatcher over
    ``sgl_kernel.merge_state_v2`` and a Triton kernel). Not ``sgl_kernel.merge_state`` (v1),
    whose LSEs are base 2: use ``merge_state_v2(..., lse_base=2)`` for that one.

    Parameters
    ----------
    prefix_output : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads, head_dim]``, float16, bfloat16 or float32; any strides with a
        contiguous last dimension.
    prefix_lse : torch.Tensor or cupy.ndarray
        ``[seq_len, num_heads]`` (token-major), natural log, float32 (float16, bfloat16 or float64
        are cast to a float32 copy). ``+inf`` is read as ``-inf``, as SGLang does.
    suffix_output : torch.Tensor or cupy.ndarray
        Like ``prefix_output``, of its shape and dtype.
    suffix_lse : torch.Tensor or cupy.ndarray
        Like ``prefix_lse``.
    output : torch.Tensor or cupy.ndarray, optional
        ``[seq_len, num_heads, head_dim]`` to write the merged values into (converted to its
        dtype); may be ``prefix_output`` or ``suffix_output`` itself. Allocated like
        ``prefix_output`` if omitted.
    output_lse : torch.Tensor or cupy.ndarray, optional
        ``[seq_len, num_heads]`` float32 to write the merged LSE into; allocated if omitted.
    stream : Stream, optional
        Where to launch (cupy-merge's extension).

    Returns
    -------
    output : torch.Tensor or cupy.ndarray
        The merged values: the given ``output`` or a new C-contiguous array.
    output_lse : torch.Tensor or cupy.ndarray
        The merged LSE, ``[seq_len, num_heads]`` float32: the given ``output_lse`` or a new array.

    Raises
    ------
    TypeError
        A dtype or array kind SGLang's layout does not allow (FP8 values too, which SGLang sends to
        a Triton kernel: dequantise them first); the message names the argument.
    ValueError
        A shape that is not SGLang's layout; the message names the argument and the layout.

    See Also
    --------
    merge_state_v2 : The same merge under ``sgl_kernel``'s names.

    Examples
    --------
    >>> import torch                                                               # doctest: +SKIP
    >>> from cupy_merge.compat import sglang
    >>> o = torch.randn(613, 32, 128, device="cuda").half()                        # doctest: +SKIP
    >>> lse = torch.randn(613, 32, device="cuda")                                  # doctest: +SKIP
    >>> output, output_lse = sglang.merge_state(o, lse, o, lse)                    # doctest: +SKIP
    """
    given = {"prefix_output": prefix_output, "prefix_lse": prefix_lse, "suffix_output": suffix_output,
             "suffix_lse": suffix_lse, "output": output, "output_lse": output_lse}  # fmt: skip
    return _MERGE_STATE(given, stream, "")  # type: ignore[return-value]


__all__ = ["merge_state", "merge_state_v2"]
