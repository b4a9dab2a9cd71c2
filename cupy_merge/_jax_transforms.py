"""cupy_merge.jax, the transformations: the traced merge with its batching rule (``vmap``: a batch
folded into the tokens where the layout allows it, one launch; mapped otherwise), its derivative
(a ``custom_vjp`` whose backward is the merge's backward kernel, batched alike), and the types
``shard_map`` checks (the mesh axes each result varies over)."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy

from . import _dispatch, _options, _tuning
from ._catalogue import FP8, MAX_STATES_PER_TOKEN
from ._jax_launch import _build_backward_entry, _Config, _Entry, _entry, _jax
from ._ops import MERGE_STATE_BACKWARD, MERGE_STATES_BACKWARD, MERGE_STATES_VARLEN_BACKWARD

#: vmap maps over at most this many batch elements by unrolled calls, beyond by ``lax.map``.
_UNROLL = 8


# -- the traced function, its batching rules and its derivative ----------------------------------


def _raw(cfg: _Config, arrays: tuple) -> tuple:
    """One merge on the traced ``arrays`` (its operands in ``cfg.fields`` order, in ``cfg.layouts``)."""
    jax = _jax()
    avals = tuple((tuple(x.shape), numpy.dtype(x.dtype)) for x in arrays)
    entry = _entry(cfg, avals)
    if entry.call is None:
        return _varying(_empty_results(cfg, entry, arrays), arrays)
    outputs = list(entry.call(*arrays))
    if entry.fp8:
        outputs[0] = jax.lax.bitcast_convert_type(outputs[0], jax.jnp.float8_e4m3fn)
    return _varying(tuple(outputs), arrays)


# -- inside shard_map: the mesh axes a value varies over (JAX's "vma" type) --------------------------


def _vma(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` (empty elsewhere, or on a JAX
    without the type)."""
    typeof = getattr(_jax().jax, "typeof", None)
    if typeof is None:
        return frozenset()
    aval = typeof(x)
    mat = getattr(aval, "mat", None)  # JAX 0.10: the axes' types; 0.6-0.9: ``vma`` alone
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _vary(x: Any, axes: frozenset) -> Any:
    """``x`` typed as varying over ``axes`` too (its values unchanged)."""
    missing = tuple(sorted(axes - _vma(x)))
    if not missing:
        return x
    lax = _jax().lax
    pcast = getattr(lax, "pcast", None)
    return pcast(x, missing, to="varying") if pcast is not None else lax.pvary(x, missing)


def _varying(results: tuple, arrays: tuple) -> tuple:
    """A callback's results typed as varying over every axis its operands vary over: XLA's
    callbacks give untyped (replicated) results, which ``shard_map``'s type check refuses where
    they meet the operands' types (a custom VJP's gradients, a scan's carry)."""
    axes = frozenset().union(*(_vma(x) for x in arrays))
    return tuple(_vary(x, axes) for x in results) if axes else results


def _typed_like(grad: Any, primal: Any) -> Any:
    """A gradient of the type of its primal inside ``shard_map``: summed over the axes the primal
    does not vary over (a replicated operand, such as the sinks, gets every shard's share, as
    JAX's own rules give it), cast to vary over those it does."""
    if grad is None:
        return None
    extra = _vma(grad) - _vma(primal)
    if extra:
        grad = _jax().lax.psum(grad, tuple(sorted(extra)))
    return _vary(grad, _vma(primal))


def _empty_results(cfg: _Config, entry: _Entry, arrays: tuple) -> tuple:
    """Results of a merge with no tokens or no heads: empty arrays (the inputs, in place)."""
    jnp = _jax().jnp
    if cfg.in_place:
        return arrays[cfg.fields.index("v_a")], arrays[cfg.fields.index("s_a")]
    results = []
    for position, (shape, dtype) in enumerate(entry.results):
        if position == 0 and entry.fp8:
            dtype = jnp.float8_e4m3fn
        fill = -numpy.inf if position == 1 else 0
        results.append(jnp.full(shape, fill, dtype))
    if cfg.scales_aliased:
        results[-1] = arrays[cfg.fields.index("output_block_scale")]
    return tuple(results)


@functools.cache
def _batched(cfg: _Config):
    """The merge of ``cfg`` with its batching rule (``jax.custom_batching.custom_vmap``)."""
    jax = _jax().jax

    def merge(*arrays):
        return _raw(cfg, arrays)

    function = jax.custom_batching.custom_vmap(merge)
    rule = _rule_many if cfg.operation.many and "indptr" not in cfg.fields else _rule_two
    if "indptr" in cfg.fields:
        rule = _rule_varlen
    function.def_vmap(functools.partial(rule, cfg))
    return function


@functools.cache
def _differentiable(cfg: _Config):
    """:func:`_batched` with its derivative: ``jax.custom_vjp`` outside the ``custom_vmap`` (the
    order JAX requires), whose backward runs the merge's backward kernel (:func:`_vjp_backward`)
    from the merge's inputs (and an N-way or ragged merge's results: its residuals)."""
    jax = _jax().jax
    function = jax.custom_vjp(_batched(cfg))
    function.defvjp(functools.partial(_vjp_forward, cfg), functools.partial(_vjp_backward, cfg))
    return function


def _vjp_forward(cfg: _Config, *arrays: Any) -> tuple:
    """The merge, keeping its inputs and results for the backward; an FP8 output is refused (it has
    no gradient: rounding to FP8 is a step function). Only a differentiated call comes here."""
    if cfg.options.out_dtype == FP8:
        raise TypeError(
            f"cupy_merge.jax.{cfg.operation.name}: an FP8 (float8_e4m3fn) output is not differentiable; merge to "
            f"float32, float16 or bfloat16 to take gradients through the merge (and quantise after it), or "
            f"apply jax.lax.stop_gradient to its inputs"
        )
    results = _once_differentiable(cfg)(*arrays)
    return results, (arrays, tuple(results[:2]) if cfg.operation.many else None)


@functools.cache
def _once_differentiable(cfg: _Config):
    """:func:`_batched` as the custom_vjp's forward calls it: a derivative of it would be a second
    derivative of the merge (``jax.grad`` of ``jax.grad``), refused clearly."""
    jax = _jax().jax
    function = jax.custom_jvp(_batched(cfg))
    function.defjvp(functools.partial(_no_second_derivative, cfg.operation.name))
    return function


def _vjp_backward(cfg: _Config, residuals: tuple, cotangents: tuple) -> tuple:
    """The gradients of every operand of ``cfg`` (None for offsets and masks): one backward kernel,
    an N-way or ragged merge's given its results (which few rows of many states read)."""
    arrays, results = residuals
    given = dict(zip(cfg.fields, arrays))
    grad_out, grad_lse = cotangents[0], cotangents[1]
    options = _options.backward_options(lse_base=2 if cfg.options.lse_base_2 else "e")
    sinks = ("sinks",) if "sinks" in given else ()
    if not cfg.operation.many:
        named = _two_way_gradients(cfg, given, grad_out, grad_lse, options)
    else:
        fields: tuple[str, ...]
        if "indptr" in given:
            operation, fields = MERGE_STATES_VARLEN_BACKWARD, ("v", "s", "indptr", "grad_out", "grad_lse")
        else:
            operation, fields = MERGE_STATES_BACKWARD, ("v", "s", "grad_out", "grad_lse")
        fields += ("merged", "merged_lse")
        values = dict(given, grad_out=grad_out, grad_lse=grad_lse, merged=results[0], merged_lse=results[1])
        grads = _backward_call(operation, options, cfg.tuning, fields + sinks, values)
        named = {"v": grads[0], "s": grads[1], "sinks": grads[2] if sinks else None}
    return tuple(_typed_like(named.get(field), given[field]) for field in cfg.fields)


def _either(*masks: Any) -> Any:
    """The union of the token masks given (None: no token)."""
    given = [mask for mask in masks if mask is not None]
    return functools.reduce(operator.or_, given) if given else None


def _two_way_gradients(cfg: _Config, given: dict, grad_out: Any, grad_lse: Any, options: Any) -> dict:
    """A two-way merge's gradients. Tokens the kernel does not merge are handed to it with empty
    (``-inf``) LSEs, which give exactly zero gradients whatever the values hold, and get their
    own after: where the mask of the in-place merge is False, ``v_a``/``s_a`` pass through (the
    gradients of an identity); past a prefill cut ``v_b``/``s_b`` do (with sinks, the kernel
    merges ``v_b`` with the sink alone there, as the forward does)."""
    jnp = _jax().jnp
    v_a, s_a, v_b, s_b = (given[field] for field in ("v_a", "s_a", "v_b", "s_b"))
    sinks, mask = given.get("sinks"), given.get("mask")
    tokens = v_a.shape[0]
    cut = getattr(cfg.options, "merge_tokens", None)
    pass_a = pass_b = only_b = None  # [T] masks: a (b) passes through; b merged with the sinks alone
    if mask is not None:
        pass_a = ~mask.astype(bool)
    if cut is not None and cut < tokens:
        tail = jnp.arange(tokens) >= cut
        pass_b, only_b = (tail, None) if sinks is None else (None, tail)
    drop_a, drop_b = _either(pass_a, pass_b, only_b), _either(pass_a, pass_b)
    if drop_a is not None:
        s_a = jnp.where(drop_a[None, :], -jnp.inf, s_a)
    kernel_lse = grad_lse
    if drop_b is not None:
        s_b = jnp.where(drop_b[None, :], -jnp.inf, s_b)
        kernel_lse = jnp.where(drop_b[None, :], 0.0, grad_lse)  # nothing merged there: no sink gradient
    values = {"v": v_a, "s": s_a, "v_b": v_b, "s_b": s_b, "grad_out": grad_out, "grad_lse": kernel_lse,
              "sinks": sinks}  # fmt: skip
    fields = ("v", "s", "v_b", "s_b", "grad_out", "grad_lse") + (() if sinks is None else ("sinks",))
    grad_v_a, grad_s_a, grad_v_b, grad_s_b, *grad_sinks = _backward_call(
        MERGE_STATE_BACKWARD, options, cfg.tuning, fields, values
    )
    if pass_a is not None:
        grad_v_a = jnp.where(pass_a[:, None, None], grad_out.astype(grad_v_a.dtype), grad_v_a)
        grad_s_a = jnp.where(pass_a[None, :], grad_lse, grad_s_a)
    if pass_b is not None:
        grad_v_b = jnp.where(pass_b[:, None, None], grad_out.astype(grad_v_b.dtype), grad_v_b)
        grad_s_b = jnp.where(pass_b[None, :], grad_lse, grad_s_b)
    return {"v_a": grad_v_a, "s_a": grad_s_a, "v_b": grad_v_b, "s_b": grad_s_b,
            "sinks": grad_sinks[0] if grad_sinks else None}  # fmt: skip


def _backward_call(operation: _dispatch.Operation, options: Any, tuning: _tuning.Tuning, fields: tuple,
                   values: dict) -> tuple:  # fmt: skip
    """One backward merge on arrays in the forward's own layouts (LSEs ``[H, T]``, N-way states
    ``[N, T, H, D]``, ``[N, H, T]``): ``(grad_v, grad_s[, grad_v_b, grad_s_b][, grad_sinks])``."""
    dense = operation is MERGE_STATES_BACKWARD
    layouts = tuple(
        "nt" if dense and field == "v" else "nht" if dense and field == "s" else
        "ht" if field in ("s", "s_b", "grad_lse", "merged_lse") else "" for field in fields
    )  # fmt: skip
    cfg = _Config(operation, options, tuning, fields, layouts)
    return tuple(_backward_function(cfg)(*(values[field] for field in fields)))


@functools.cache
def _backward_function(cfg: _Config):
    """:func:`_backward_batched` behind a derivative rule that refuses (second derivatives)."""
    jax = _jax().jax
    function = jax.custom_jvp(_backward_batched(cfg))
    function.defjvp(functools.partial(_no_second_derivative, cfg.operation.name))
    return function


def _no_second_derivative(name: str, primals: Any, tangents: Any) -> Any:
    merge = name.removesuffix("_backward")
    raise NotImplementedError(
        f"cupy_merge.jax.{merge}: merges are differentiable once; the gradient of a merge is not "
        f"differentiable again (jax.grad of jax.grad, jax.hessian, forward mode over a gradient are refused "
        f"rather than wrong)"
    )


def _sequential(cfg: _Config, size: int, in_batched: list, args: tuple, function: Any = None):
    """vmap by mapping: one merge (``function``, the merge of ``cfg`` by default) per batch element
    (unrolled when few), stacked."""
    jax = _jax()
    function = function or _batched(cfg)
    if 0 < size <= _UNROLL:
        results = [
            function(*(x[i] if batched else x for x, batched in zip(args, in_batched))) for i in range(size)
        ]
        stacked = tuple(jax.jnp.stack(column) for column in zip(*results))
    else:
        mapped = tuple(x for x, batched in zip(args, in_batched) if batched)

        def one(slices):
            given = iter(slices)
            return function(*(next(given) if batched else x for x, batched in zip(args, in_batched)))

        stacked = tuple(jax.lax.map(one, mapped))
    return stacked, (True,) * len(stacked)


def _broadcast(x: Any, batched: bool, size: int) -> Any:
    return x if batched else _jax().jnp.broadcast_to(x, (size, *x.shape))


def _lse_token_major(x: Any, layout: str, batched: bool, size: int) -> Any:
    """A batch of 2-D LSEs ([B, H, T] "ht" or [B, T, H] "th") as one token-major [B * T, H] buffer:
    free for "th" and for one token; a transpose of the (small) LSE otherwise."""
    x = _broadcast(x, batched, size)
    if layout == "th":
        return x.reshape(size * x.shape[1], x.shape[2])
    _, heads, tokens = x.shape
    if tokens == 1:
        return x.reshape(size, heads)
    return _jax().jnp.swapaxes(x, 1, 2).reshape(size * tokens, heads)


def _lse_unfold(x: Any, size: int, tokens: int, layout: str) -> Any:
    """A token-major [B * T, H] result back to the batch of ``layout`` ([B, H, T] or [B, T, H])."""
    heads = x.shape[-1]
    x = x.reshape(size, tokens, heads)
    if layout == "th":
        return x
    if tokens == 1:
        return x.reshape(size, heads, 1)
    return _jax().jnp.swapaxes(x, 1, 2)


def _fold_rows(x: Any, batched: bool, size: int) -> Any:
    """[B, T, ...] (broadcast when unbatched) as [B * T, ...]: free for dense token-major arrays."""
    x = _broadcast(x, batched, size)
    return x.reshape(size * x.shape[1], *x.shape[2:])


def _unfold(cfg: _Config, outputs: tuple, size: int, tokens: int) -> tuple:
    out = outputs[0].reshape(size, tokens, *outputs[0].shape[1:])
    unfolded = [out, _lse_unfold(outputs[1], size, tokens, cfg.out_layout)]
    if len(outputs) > 2:
        unfolded.append(outputs[2].reshape(size, tokens, outputs[2].shape[-1]))
    return tuple(unfolded)


def _rule_two(cfg: _Config, size: int, in_batched: list, *args: Any):
    """Two-way merges: B folded into the tokens ([B, T, H, D] -> [B * T, H, D], free; the LSEs
    token-major, free for one token), one launch. Sequential when a value array, the sinks or the
    scale is not batched alike, or a prefill cut would fall inside the folded tokens."""
    if cfg.in_place:
        # The outputs alias v_a and s_a: each batch element needs its own copy to be written into
        # (mapped elements sharing one unbatched buffer would all write into it), and so the
        # whole batch folds into one launch.
        args = tuple(_broadcast(x, batched, size) if field in ("v_a", "s_a", "v_b", "s_b") else x
                     for field, x, batched in zip(cfg.fields, args, in_batched))  # fmt: skip
        in_batched = [batched or field in ("v_a", "s_a", "v_b", "s_b") for field, batched in zip(cfg.fields, in_batched)]
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    tokens = given["v_a"].shape[-3]
    cut = getattr(cfg.options, "merge_tokens", None)
    if not (batched["v_a"] and batched["v_b"]) or batched.get("sinks") or batched.get("output_scale"):
        return _sequential(cfg, size, in_batched, args)
    if cut is not None:
        # The cut counts each batch element's own tokens: one past every token is no cut at all,
        # and one inside them would fall once into the folded tokens, so each element is merged alone.
        if cut < tokens:
            return _sequential(cfg, size, in_batched, args)
        cfg = cfg._replace(options=cfg.options._replace(merge_tokens=None))
    folded, inner = _fold_tokens(cfg, size, in_batched, args)
    outputs = _batched(inner._replace(out_layout="th"))(*folded)
    return _unfold(cfg, outputs, size, tokens), (True,) * len(outputs)


#: How a batch folds into the tokens of each operand of a two-way merge and its gradient: "rows"
#: ([B, T, ...] -> [B * T, ...], free), "lse" ([B, H, T] or [B, T, H] -> token-major [B * T, H]),
#: "shared" (one for the whole batch: the sinks, the scale).
_FOLDS = {
    "v_a": "rows", "v_b": "rows", "v": "rows", "mask": "rows", "output_block_scale": "rows", "grad_out": "rows",
    "merged": "rows", "s_a": "lse", "s_b": "lse", "s": "lse", "grad_lse": "lse", "merged_lse": "lse",
    "sinks": "shared", "output_scale": "shared",
}  # fmt: skip


def _fold_tokens(cfg: _Config, size: int, in_batched: list, args: tuple) -> tuple[list, _Config]:
    """A two-way merge's (or gradient's) operands with the batch folded into their tokens, and the
    config of the folded call (LSEs token-major)."""
    folded, layouts = [], []
    for field, layout, x, batched in zip(cfg.fields, cfg.layouts, args, in_batched):
        fold = _FOLDS[field]
        if fold == "rows":
            x = _fold_rows(x, batched, size)
        elif fold == "lse":
            x, layout = _lse_token_major(x, layout, batched, size), "th"
        folded.append(x)
        layouts.append(layout)
    return folded, cfg._replace(layouts=tuple(layouts))


def _rule_many(cfg: _Config, size: int, in_batched: list, *args: Any):
    """N-way merges: B folded into the tokens where the values allow it for free (one token, one
    state, or token-major values), the LSE made token-major; sequential otherwise."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, layout = given["v"], cfg.layout("v")
    if not batched["v"] or batched.get("sinks") or batched.get("output_scale"):
        return _sequential(cfg, size, in_batched, args)
    if layout == "tn":
        _, tokens, states, heads, head_size = v.shape
        v, v_layout = v.reshape(size * tokens, states, heads, head_size), "tn"
    else:
        _, states, tokens, heads, head_size = v.shape
        if tokens == 1:  # [B, N, 1, H, D] is token-major [T' = B, N, H, D]
            v, v_layout = v.reshape(size, states, heads, head_size), "tn"
        elif states == 1:
            v, v_layout = v.reshape(1, size * tokens, heads, head_size), "nt"
        else:  # folding would copy every value: one launch per batch element instead
            return _sequential(cfg, size, in_batched, args)
    s = _broadcast(given["s"], batched["s"], size)
    if cfg.layout("s") == "tnh":
        s = s.reshape(size * tokens, states, heads)
    elif tokens == 1:
        s = s.reshape(size, states, heads)
    else:
        s = jnp.transpose(s, (0, 3, 1, 2)).reshape(size * tokens, states, heads)
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(v)
        elif field == "s":
            folded.append(s)
        elif field == "output_block_scale":
            folded.append(_fold_rows(x, batched[field], size))
        else:
            folded.append(x)
    layouts = tuple(
        v_layout if field == "v" else "tnh" if field == "s" else lay
        for field, lay in zip(cfg.fields, cfg.layouts)
    )
    outputs = _batched(cfg._replace(layouts=layouts, out_layout="th"))(*folded)
    return _unfold(cfg, outputs, size, tokens), (True,) * len(outputs)


def _rule_varlen(cfg: _Config, size: int, in_batched: list, *args: Any):
    """Ragged merges: the batches' rows back to back ([B, S, H, D] -> [B * S, H, D], free), each
    batch's offsets shifted by its first row, and one extra token a batch spanning the rows
    between its last offset and the next batch's first (dropped after). Offsets a batch's own
    rows do not cover give NaN, as unbatched. Sequential when the values, sinks or scale are not
    batched alike, or group scales are given to write into."""
    jax = _jax()
    jnp = jax.jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, indptr = given["v"], given["indptr"]
    tokens = indptr.shape[-1] - 1
    if not batched["v"] or batched.get("sinks") or batched.get("output_scale") or cfg.scales_aliased:
        return _sequential(cfg, size, in_batched, args)
    _, rows, heads, head_size = v.shape
    if tokens == 0 or (indptr.dtype == numpy.int32 and size * rows >= 2**31 - 1):  # int32 offsets overflow
        return _sequential(cfg, size, in_batched, args)
    indptr = _broadcast(indptr, batched["indptr"], size)
    begin, end = indptr[:, :-1], indptr[:, 1:]
    valid = (begin >= 0) & (end >= begin) & (end <= rows) & (end - begin <= MAX_STATES_PER_TOKEN)
    shifted = jnp.clip(indptr, 0, rows) + (jnp.arange(size, dtype=indptr.dtype) * rows)[:, None]
    offsets = jnp.concatenate([shifted.reshape(-1), jnp.full((1,), size * rows, indptr.dtype)])
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(v.reshape(size * rows, heads, head_size))
        elif field == "s":
            folded.append(_lse_token_major(x, cfg.layout("s"), batched["s"], size))
        elif field == "indptr":
            folded.append(offsets)
        else:
            folded.append(x)
    layouts = tuple("th" if field == "s" else lay for field, lay in zip(cfg.fields, cfg.layouts))
    outputs = _batched(cfg._replace(layouts=layouts, out_layout="th"))(*folded)
    kept = tokens + 1
    out = outputs[0].reshape(size, kept, heads, head_size)[:, :tokens]
    lse = outputs[1].reshape(size, kept, heads)[:, :tokens]
    results = [
        jnp.where(valid[:, :, None, None], out, jnp.nan),
        _lse_unfold(jnp.where(valid[:, :, None], lse, jnp.nan).reshape(size * tokens, heads), size, tokens,
                    cfg.out_layout),
    ]  # fmt: skip
    if len(outputs) > 2:
        scales = outputs[2].reshape(size, kept, outputs[2].shape[-1])[:, :tokens]
        results.append(jnp.where(valid[:, :, None], scales, jnp.nan))
    return tuple(results), (True,) * len(results)


def _raw_backward(cfg: _Config, arrays: tuple) -> tuple:
    """One backward merge on the traced ``arrays`` (``cfg.fields`` order, in ``cfg.layouts``)."""
    jnp = _jax().jnp
    avals = tuple((tuple(x.shape), numpy.dtype(x.dtype)) for x in arrays)
    entry = _entry(cfg, avals, _build_backward_entry)
    kept = len(entry.results) - entry.scratch
    if entry.call is None:
        return tuple(jnp.zeros(shape, dtype) for shape, dtype in entry.results[:kept])
    return _varying(tuple(entry.call(*arrays))[:kept], arrays)


@functools.cache
def _backward_batched(cfg: _Config):
    """The backward merge of ``cfg`` with its batching rule (vmap of a gradient, gradient of a vmap)."""
    jax = _jax().jax

    def gradients(*arrays):
        return _raw_backward(cfg, arrays)

    function = jax.custom_batching.custom_vmap(gradients)
    rule = {
        MERGE_STATE_BACKWARD: _rule_two_backward,
        MERGE_STATES_BACKWARD: _rule_many_backward,
        MERGE_STATES_VARLEN_BACKWARD: _rule_varlen_backward,
    }[cfg.operation]
    function.def_vmap(functools.partial(rule, cfg))
    return function


def _backward_sequential(cfg: _Config, size: int, in_batched: list, args: tuple):
    return _sequential(cfg, size, in_batched, args, _backward_batched(cfg))


def _rows_unfold(x: Any, size: int, tokens: int) -> Any:
    return x.reshape(size, tokens, *x.shape[1:])


def _rule_two_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """A two-way merge's gradients, batched as the merge is: B folded into the tokens, one launch;
    one launch a batch element when a value array is not batched or with sinks (whose gradient
    sums over the tokens: each batch element has its own)."""
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    if not (batched["v"] and batched["v_b"]) or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    tokens = given["v"].shape[-3]
    folded, inner = _fold_tokens(cfg, size, in_batched, args)
    grads = _backward_batched(inner)(*folded)
    results = tuple(
        _lse_unfold(grad, size, tokens, cfg.layout(of)) if _FOLDS[of] == "lse" else _rows_unfold(grad, size, tokens)
        for grad, of in zip(grads, ("v", "s", "v_b", "s_b"))
    )
    return results, (True,) * 4


def _rule_many_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """An N-way merge's gradients, folded as the merge folds (one token, one state, or token-major
    values: free for the values); one launch a batch element otherwise, or with sinks."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, layout = given["v"], cfg.layout("v")
    if not batched["v"] or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    if layout == "tn":
        _, tokens, states, heads, head_size = v.shape
        folded_v, v_layout = v.reshape(size * tokens, states, heads, head_size), "tn"
    else:
        _, states, tokens, heads, head_size = v.shape
        if tokens == 1:
            folded_v, v_layout = v.reshape(size, states, heads, head_size), "tn"
        elif states == 1:
            folded_v, v_layout = v.reshape(1, size * tokens, heads, head_size), "nt"
        else:
            return _backward_sequential(cfg, size, in_batched, args)
    s = _broadcast(given["s"], batched["s"], size)
    transposed = cfg.layout("s") != "tnh" and tokens != 1
    if transposed:
        folded_s = jnp.transpose(s, (0, 3, 1, 2)).reshape(size * tokens, states, heads)
    else:
        folded_s = s.reshape(size * tokens, states, heads)
    folded = []
    for field, x in zip(cfg.fields, args):
        if field == "v":
            folded.append(folded_v)
        elif field == "s":
            folded.append(folded_s)
        elif field in ("grad_out", "merged"):
            folded.append(_fold_rows(x, batched[field], size))
        else:  # grad_lse, merged_lse
            folded.append(_lse_token_major(x, cfg.layout(field), batched[field], size))
    layouts = tuple(
        v_layout if field == "v" else "tnh" if field == "s" else "th" if field in ("grad_lse", "merged_lse") else lay
        for field, lay in zip(cfg.fields, cfg.layouts)
    )  # fmt: skip
    grad_v, grad_s = _backward_batched(cfg._replace(layouts=layouts))(*folded)
    if transposed:
        grad_s = jnp.transpose(grad_s.reshape(size, tokens, states, heads), (0, 2, 3, 1))
    else:
        grad_s = grad_s.reshape(s.shape)
    return (grad_v.reshape(v.shape), grad_s), (True, True)


def _pad_token(x: Any, layout: str) -> Any:
    """One more token of zeros at the end of each batch element's token axis."""
    axis = {"th": 1, "ht": 2}.get(layout, 1)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, 1)
    return _jax().jnp.pad(x, widths)


def _rule_varlen_backward(cfg: _Config, size: int, in_batched: list, *args: Any):
    """A ragged merge's gradients, folded as the merge folds (the batches' rows back to back, their
    offsets shifted, one extra token a batch over the rows between batches, with zero
    cotangents). Rows that no token with offsets in range owns are handed to the kernel with
    empty LSEs, so they (the extra tokens' included) get zero gradients whatever their values
    hold, as unbatched. Gradients need non-decreasing offsets, batched or not. One launch a
    batch element when the values are not batched, with sinks, or when a batch element holds
    more rows than a token may have states (the extra token would be out of range, and the
    kernel zeroes such a token's rows with one row of threads a head)."""
    jnp = _jax().jnp
    batched = dict(zip(cfg.fields, in_batched))
    given = dict(zip(cfg.fields, args))
    v, indptr = given["v"], given["indptr"]
    tokens = indptr.shape[-1] - 1
    if not batched["v"] or "sinks" in given:
        return _backward_sequential(cfg, size, in_batched, args)
    _, rows, heads, head_size = v.shape
    if tokens == 0 or rows > MAX_STATES_PER_TOKEN or (indptr.dtype == numpy.int32 and size * rows >= 2**31 - 1):
        return _backward_sequential(cfg, size, in_batched, args)
    indptr = _broadcast(indptr, batched["indptr"], size)
    begin, end = indptr[:, :-1], indptr[:, 1:]
    valid = (begin >= 0) & (end >= begin) & (end <= rows)  # the backward kernel's own rule
    shifted = jnp.clip(indptr, 0, rows) + (jnp.arange(size, dtype=indptr.dtype) * rows)[:, None]
    offsets = jnp.concatenate([shifted.reshape(-1), jnp.full((1,), size * rows, indptr.dtype)])
    batch = jnp.arange(size)[:, None]
    edges = jnp.zeros((size, rows + 1), jnp.int32)
    edges = (
        edges.at[batch, jnp.where(valid, begin, rows)].add(1).at[batch, jnp.where(valid, end, rows)].add(-1)
    )
    owned = jnp.cumsum(edges, axis=1)[:, :rows] > 0  # [B, rows]
    folded = []
    for field, x in zip(cfg.fields, args):
        layout = cfg.layout(field)
        if field == "v":
            folded.append(v.reshape(size * rows, heads, head_size))
        elif field == "s":
            x = _broadcast(x, batched[field], size)
            keep = owned[:, :, None] if layout == "th" else owned[:, None, :]
            folded.append(_lse_token_major(jnp.where(keep, x, -jnp.inf), layout, True, size))
        elif field == "indptr":
            folded.append(offsets)
        elif field in ("grad_out", "merged"):
            folded.append(_fold_rows(_pad_token(_broadcast(x, batched[field], size), "th"), True, size))
        else:  # grad_lse, merged_lse (the extra tokens' 0: their rows' empty LSEs give weights of 0)
            x = _broadcast(x, batched[field], size)
            if field == "merged_lse":  # offsets out of range merged to NaN; folded, their rows are -inf
                x = jnp.where(valid[:, :, None] if layout == "th" else valid[:, None, :], x, -jnp.inf)
            folded.append(_lse_token_major(_pad_token(x, layout), layout, True, size))
    layouts = tuple(
        "th" if field in ("s", "grad_lse", "merged_lse") else lay for field, lay in zip(cfg.fields, cfg.layouts)
    )
    grad_v, grad_s = _backward_batched(cfg._replace(layouts=layouts))(*folded)
    results = (grad_v.reshape(size, rows, heads, head_size), _lse_unfold(grad_s, size, rows, cfg.layout("s")))
    return results, (True, True)
