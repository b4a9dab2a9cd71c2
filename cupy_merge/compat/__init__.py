"""Drop-in modules with the peers' own signatures, layouts and LSE bases.

Each function takes the peer's arguments in the peer's layout, checks them
against that layout (errors name the peer's arguments), and calls one core
merge on zero-copy views (transposes and permutes); outputs the peer returns
are allocated in the peer's layout and written through transposed views. A
drop-in is declared (``_peer.PeerMerge``: the core operation, each argument's
operand and axes in the peer's names) and all of that is derived from it.

* :mod:`cupy_merge.compat.flashinfer`: FlashInfer's ``merge_state``, ``merge_state_in_place``,
  ``merge_states`` and ``flashinfer.triton.cascade.variable_length_merge_states``; LSE
  token-major ``[seq_len, num_heads]``, **base 2**;
* :mod:`cupy_merge.compat.sglang`: SGLang's ``merge_state_v2`` and its serving code's
  ``merge_state`` (``sglang.srt``, the same merge under other names); LSE token-major
  ``[seq_len, num_heads]``, natural log;
* :mod:`cupy_merge.compat.flash_attn`: FlashAttention's ``flash_attn_combine`` (FA4's signature,
  a superset of FA3's); split-major partials, LSE ``[..., seqlen, num_heads]``, natural log;
* :mod:`cupy_merge.compat.xformers`: xFormers' ``fmha.merge_attentions``; chunk-major partials
  ``[num_chunks, B, M, (G,) H, Kq]`` (or a sequence of chunks), LSE ``[..., (G,) H, M]``, natural log.

vLLM's ``merge_attn_states`` is :func:`cupy_merge.merge_attn_states` itself (also named
:mod:`cupy_merge.compat.vllm`). Results come back
in the caller's array kind (torch in, torch out; CuPy in, CuPy out; other DLPack producers get
CuPy). JAX arrays are refused: these functions write into arrays they allocate. The porting
table is in ``docs/porting.rst``. The public names are the five modules; the helpers
defined here (layout checks in the peers' words, views, allocation) serve them.

>>> from cupy_merge.compat import flashinfer                  # doctest: +SKIP
>>> V, S = flashinfer.merge_state(v_a, s_a, v_b, s_b)        # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import cupy_merge as _cm

from .. import _arrays

#: The value dtypes every peer's values may have here (the core's).
VALUE_DTYPES = ("float32", "float16", "bfloat16")
#: LSE dtypes a peer casts to float32 itself (``s.to(torch.float32)``); cast here too, a copy.
CASTABLE_LSE_DTYPES = ("float16", "bfloat16", "float64")
INDEX_DTYPES = ("int32", "int64")


# -- the caller's arrays --------------------------------------------------------------------------


def take(obj: Any, name: str) -> tuple[Any, _arrays.Adapter]:
    """``obj`` as a torch tensor or CuPy array (a DLPack producer as a zero-copy CuPy view), and its
    adapter; a JAX array (immutable), a NumPy array or anything else raises ``TypeError``."""
    adapter = _arrays.adapter_for(obj, name)
    if adapter.kind == "jax":
        raise TypeError(
            f"{name}: expected a torch tensor or a CuPy array, got a JAX array; JAX arrays are "
            "immutable and cupy_merge.compat writes its results into arrays it allocates in the "
            "peer's layout. Call the core merge (cupy_merge.merge_state, merge_states, ...) with the "
            "LSE transposed to [num_heads, num_tokens] instead (see docs/porting.rst)"
        )
    if adapter.kind == "other":
        return _arrays.as_cupy(obj, name), _arrays.CUPY
    expect_cuda(obj, name)
    return obj, adapter


def expect_cuda(obj: Any, name: str) -> None:
    """A torch tensor on a CUDA device (refused here, in the peer's argument names, rather than by
    the core, which names its own arguments)."""
    if is_torch(obj) and obj.device.type != "cuda":
        raise TypeError(
            f"{name}: expected a torch tensor on a CUDA device, got one on {obj.device}; move it with .cuda()"
        )


def is_torch(obj: Any) -> bool:
    torch = _arrays.torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def shape_of(obj: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in obj.shape)


def dtype_of(obj: Any) -> str:
    return _arrays.dtype_name(obj.dtype)


def element_strides(obj: Any) -> tuple[int, ...] | None:
    """Strides in elements, or None where a CuPy stride is not a whole number of elements."""
    if is_torch(obj):
        return tuple(obj.stride())
    itemsize = obj.itemsize
    if any(stride % itemsize for stride in obj.strides):
        return None
    return tuple(stride // itemsize for stride in obj.strides)


def permute(obj: Any, *axes: int) -> Any:
    """A view with its axes in this order (torch ``permute``, CuPy ``transpose``): never a copy."""
    return obj.permute(*axes) if is_torch(obj) else obj.transpose(axes)


def fold(obj: Any, axis: int) -> Any | None:
    """A view with axes ``axis`` and ``axis + 1`` as one (row-major), or None where their strides
    do not allow it without a copy. One of extent 1, or an empty array, always folds."""
    shape = shape_of(obj)
    strides = element_strides(obj)
    if strides is None:
        return None
    outer, inner = shape[axis], shape[axis + 1]
    if outer * inner == 0:
        stride = 1
    elif inner == 1:
        stride = strides[axis]
    elif outer == 1 or strides[axis] == inner * strides[axis + 1]:
        stride = strides[axis + 1]
    else:
        return None
    new_shape = shape[:axis] + (outer * inner,) + shape[axis + 2 :]
    new_strides = strides[:axis] + (stride,) + strides[axis + 2 :]
    if is_torch(obj):
        return obj.as_strided(new_shape, new_strides)  # at its own storage offset (traceable: no .storage_offset())
    import cupy

    return cupy.lib.stride_tricks.as_strided(
        obj, shape=new_shape, strides=tuple(s * obj.itemsize for s in new_strides)
    )


def device_of(obj: Any) -> int:
    """The CUDA device index (torch CPU tensors: the core's ``HOST``, for the CPU tests' fakes)."""
    if is_torch(obj):
        return int(obj.get_device())
    return int(obj.device.id)


def stream_pointer(stream: Any) -> int | None:
    return None if stream is None else _arrays.stream_pointer(stream)


def empty(like: Any, adapter: _arrays.Adapter, shape: tuple[int, ...], dtype: str, stream: Any) -> Any:
    """A new C-contiguous array of ``like``'s kind and device, for the stream that writes it."""
    return adapter.empty(tuple(shape), dtype, device_of(like), stream_pointer(stream))


def bytes_as_bool(obj: Any) -> Any:
    """A bool view of a 1-byte array (no copy): the kernels read a mask's bytes, nonzero merging."""
    if is_torch(obj):
        return obj.view(_arrays.torch_module().bool)
    return obj.view("bool")


def cast(obj: Any, dtype: str) -> Any:
    """A copy of ``obj`` as ``dtype`` (what a peer's ``.to(dtype)`` does)."""
    if is_torch(obj):
        return obj.to(getattr(_arrays.torch_module(), dtype))
    return obj.astype(dtype)


# -- the core merges on the peers' batched layouts ----------------------------------------------


def merge_batched(values: Any, lses: Any, out: Any, lse_store: Any, stream: Any) -> None:
    """The N-way merge of ``values`` [S, B, L, H, D] and ``lses`` [S, B, L, H] (states S, batch B, rows L)
    into ``out`` [B, L, H, D] and ``lse_store`` [B, H, L]: one core merge where B and L fold into one
    token axis in every array, else one per batch element (or per row position, where there are
    fewer of them). Views, no copy."""
    _, batch_size, seqlen, _, _ = shape_of(values)
    lse = permute(lse_store, 0, 2, 1)
    folded = (fold(values, 1), fold(lses, 1), fold(out, 0), fold(lse, 0))
    if all(view is not None for view in folded):
        values_rows, lses_rows, out_rows, lse_rows = folded
        _cm.merge_states(
            values_rows,
            permute(lses_rows, 0, 2, 1),
            out=out_rows,
            out_lse=permute(lse_rows, 1, 0),
            stream=stream,
        )
    elif batch_size <= seqlen:
        for b in range(batch_size):
            _cm.merge_states(
                values[:, b], permute(lses[:, b], 0, 2, 1), out=out[b], out_lse=lse_store[b], stream=stream
            )
    else:
        for row in range(seqlen):
            _cm.merge_states(
                values[:, :, row], permute(lses[:, :, row], 0, 2, 1),
                out=out[:, row], out_lse=permute(lse_store[:, :, row], 1, 0), stream=stream,
            )  # fmt: skip



# -- checks in the peer's words -------------------------------------------------------------------


def dims(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def expect_ndim(obj: Any, ndim: int, name: str, layout: str, convention: str) -> tuple[int, ...]:
    shape = shape_of(obj)
    if len(shape) != ndim:
        raise ValueError(
            f"{name}: expected a {ndim}-D array {layout} ({convention}), got shape {dims(shape)}"
        )
    return shape


def expect_values(obj: Any, name: str, ndim: int, layout: str, convention: str) -> tuple[int, ...]:
    """A value array: its rank, a value dtype, a contiguous last dimension; its shape."""
    shape = expect_ndim(obj, ndim, name, layout, convention)
    expect_dtype(obj, name, VALUE_DTYPES)
    expect_unit_last_stride(obj, name, layout)
    return shape


def expect_dtype(obj: Any, name: str, allowed: tuple[str, ...], what: str = "dtype") -> str:
    dtype = dtype_of(obj)
    if dtype not in allowed:
        choices = ", ".join(allowed[:-1]) + " or " + allowed[-1] if len(allowed) > 1 else allowed[0]
        raise TypeError(f"{name}: expected {what} {choices}, got {dtype}")
    return dtype


def expect_unit_last_stride(obj: Any, name: str, layout: str) -> None:
    shape, strides = shape_of(obj), element_strides(obj)
    if strides is not None and shape[-1] > 1 and strides[-1] != 1 and 0 not in shape:
        raise ValueError(
            f"{name}: expected its last dimension of {layout} to be contiguous (stride 1), got strides "
            f"{strides} in elements"
        )


def expect_like(obj: Any, like: Any, name: str, like_name: str) -> None:
    """Another value array of ``like``'s shape and dtype (the peers reinterpret a mismatched dtype)."""
    if shape_of(obj) != shape_of(like):
        raise ValueError(
            f"{name}: expected the shape of {like_name}, {dims(shape_of(like))}, got {dims(shape_of(obj))}"
        )
    if dtype_of(obj) != dtype_of(like):
        raise TypeError(f"{name}: expected the dtype of {like_name}, {dtype_of(like)}, got {dtype_of(obj)}")


def expect_shape(
    obj: Any,
    shape: tuple[int, ...],
    name: str,
    layout: str,
    source: str,
    convention: str,
    swapped_hint: str = "",
) -> None:
    """``obj`` of ``shape`` (``layout`` in words, read from ``source``); a hint when it has the last
    two extents swapped (a layout of another library)."""
    got = shape_of(obj)
    if got == tuple(shape):
        return
    hint = ""
    if swapped_hint and len(got) >= 2 and got == tuple(shape[:-2]) + (shape[-1], shape[-2]):
        hint = f"; {swapped_hint}"
    raise ValueError(
        f"{name}: expected shape {layout} = {dims(tuple(shape))} from {source} ({convention}), got {dims(got)}{hint}"
    )


def lse_input(
    obj: Any,
    name: str,
    shape: tuple[int, ...],
    layout: str,
    source: str,
    convention: str,
    *,
    castable: bool,
    swapped_hint: str = "",
    cast_note: str = "",
) -> Any:
    """An input LSE of ``shape``: float32 as it is, or (``castable``: the peer casts it itself) a
    float32 copy of a float16, bfloat16 or float64 one."""
    obj, _ = take(obj, name)
    expect_ndim(obj, len(shape), name, layout, convention)
    expect_shape(obj, shape, name, layout, source, convention, swapped_hint)
    dtype = dtype_of(obj)
    if dtype == "float32":
        return obj
    if castable and dtype in CASTABLE_LSE_DTYPES:
        return cast(obj, "float32")
    expected = "float32 (" + convention + ")"
    if castable:
        expected += ", or float16, bfloat16 or float64 (cast to a float32 copy, as the peer does)"
    raise TypeError(f"{name}: expected dtype {expected}, got {dtype}{cast_note}")


def lse_output(obj: Any, name: str, shape: tuple[int, ...], layout: str, source: str, convention: str) -> Any:
    obj, _ = take(obj, name)
    expect_ndim(obj, len(shape), name, layout, convention)
    expect_shape(obj, shape, name, layout, source, convention)
    expect_dtype(obj, name, ("float32",))
    return obj


def index_array(obj: Any, name: str, allowed: tuple[str, ...], layout: str) -> Any:
    obj, _ = take(obj, name)
    shape = shape_of(obj)
    if len(shape) != 1:
        raise ValueError(f"{name}: expected a 1-D array {layout}, got shape {dims(shape)}")
    expect_dtype(obj, name, allowed)
    return obj


def refuse_grad(arrays: Iterable[tuple[str, Any]], differentiable: str) -> None:
    """In grad mode, a tensor of ``arrays`` (name, array pairs, read only in grad mode) that requires
    grad is refused, naming it: the drop-ins are not differentiable (nor are their peers' kernels);
    the core merge ``differentiable`` is."""
    torch = _arrays.torch_module()
    if torch is None or not torch.is_grad_enabled():
        return
    for name, obj in arrays:
        if isinstance(obj, torch.Tensor) and obj.requires_grad:
            raise RuntimeError(
                f"{name}: requires grad, and the drop-ins are not differentiable (nor are the peers' kernels); "
                f"call cupy_merge.{differentiable} in the core's layout (docs/porting.rst), whose gradients are "
                f"defined, or merge under torch.no_grad()"
            )


def expect_flag(value: Any, name: str, none: bool = False) -> None:
    if not (isinstance(value, bool) or (none and value is None)):
        expected = "None, True or False" if none else "True or False"
        raise TypeError(f"{name}: expected {expected}, got {value!r}")


# The modules use the helpers above.
from . import flash_attn, flashinfer, sglang, vllm, xformers

__all__ = ["flash_attn", "flashinfer", "sglang", "vllm", "xformers"]
