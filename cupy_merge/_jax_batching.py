"""cupy_merge.jax, the batching rule (``vmap``) of every merge and gradient, derived from its
operands' declared layouts (``_ops``): a batch of B folds into the tokens of each operand (free
for token-major arrays), so that B merges are one launch; where a fold would copy the values or
change a result, each batch element is merged alone (unrolled when few, by ``lax.map`` beyond).

What must stay one a batch element: the sinks and the scale (one a launch), the sinks' gradient
(a sum over an element's tokens), a prefill cut (it counts an element's own tokens), ragged
offsets (each element's shifted by its first row, with one extra token a batch over the rows
between elements, dropped after).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy

from ._catalogue import MAX_STATES_PER_TOKEN, NVFP4
from ._jax_launch import _Config, _jax
from ._ops import LSE, OFFSETS, PER_HEAD, ROW_LSE, ROWS, SCALAR, STACKED, STACKED_LSE, VALUES

#: vmap maps over at most this many batch elements by unrolled calls, beyond by ``lax.map``.
_UNROLL = 8

#: The results of a call, in the order it returns them (a forward's group scales last; a
#: backward's gradients of v and s, then of v_b and s_b), and the operand each takes its order of.
_FORWARD_RESULTS = ("out", "out_lse", "output_block_scale")
_GRADIENT_OF = {"grad_v": "v", "grad_s": "s", "grad_v_b": "v_b", "grad_s_b": "s_b"}

Merge = Callable[[_Config], Any]  # the batched function of a config (its own vmap rule included)


class _Ragged(NamedTuple):
    rows: int  # a batch element's rows
    offsets: Any  # [B * (T + 1) + 1]: each element's shifted by its first row, an extra token's after
    valid: Any  # [B, T]: the token's offsets in range (the unbatched merge's rule)
    owned: Any  # [B, R]: the rows a valid token owns (gradients: the rest get empty LSEs); None forward


class _Fold(NamedTuple):
    """How a batch of ``size`` folds into one call: what each operand's layout needs to know."""

    size: int
    tokens: int  # a batch element's tokens (ragged: without the extra one)
    options: Any  # the folded call's (a prefill cut past every token dropped)
    stacked: tuple = ()  # stacked values: an element's shape, and their order in the folded call
    ragged: _Ragged | None = None


def rule(merge: Merge, cfg: _Config, size: int, in_batched: list, *args: Any):
    """``custom_vmap`` rule of ``cfg``'s merge (``merge(cfg)`` the batched function of a config):
    one launch over the folded batch, or one a batch element where it cannot fold."""
    if cfg.in_place:
        # The outputs alias v_a and s_a: each batch element needs its own copy to be written into
        # (mapped elements sharing one unbatched buffer would all write into it), and so the whole
        # batch folds into one launch.
        owned = ("v_a", "s_a", "v_b", "s_b")
        args = tuple(_broadcast(x, batched, size) if field in owned else x
                     for field, x, batched in zip(cfg.fields, args, in_batched))  # fmt: skip
        in_batched = [batched or field in owned for field, batched in zip(cfg.fields, in_batched)]
    fold = _fold_of(cfg, size, dict(zip(cfg.fields, in_batched)), dict(zip(cfg.fields, args)))
    if fold is None:
        return sequential(merge(cfg), size, in_batched, args)
    layouts = cfg.operation.layouts
    operands, orders = [], []
    for field, order, x, batched in zip(cfg.fields, cfg.layouts, args, in_batched):
        x, order = _fold_operand(fold, layouts[field], field, order, x, batched)
        operands.append(x)
        orders.append(order)
    outputs = merge(cfg._replace(options=fold.options, layouts=tuple(orders), out_layout="th"))(*operands)
    names = tuple(_GRADIENT_OF) if cfg.operation.is_backward else _FORWARD_RESULTS
    results = []
    for name, x in zip(names, outputs):
        field = _GRADIENT_OF.get(name, name)
        order = cfg.out_layout if name == "out_lse" else cfg.layout(field) if field in cfg.fields else ""
        results.append(_unfold_result(fold, layouts[field], order, x))
    return tuple(results), (True,) * len(results)


def sequential(function: Any, size: int, in_batched: list, args: tuple):
    """vmap by mapping: ``function`` once a batch element (unrolled when few), stacked."""
    jax = _jax()
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


def _fold_of(cfg: _Config, size: int, batched: dict, given: dict) -> _Fold | None:
    """How this batch folds, or None where it cannot: a sinks or scale batched (one a launch), the
    sinks' gradient (a sum over each element's tokens), values shared by the batch (merged one by
    one rather than copied B times), a prefill cut inside an element's tokens, stacked values
    whose fold would copy them, ragged offsets that would overflow, group scales written in
    place (their extra tokens) or NVFP4 block scales (swizzled by each element's tokens)."""
    layouts = cfg.operation.layouts
    backward = cfg.operation.is_backward
    if any(batched[field] for field in given if layouts[field] in (PER_HEAD, SCALAR)):
        return None
    if getattr(cfg.options, "out_dtype", None) == NVFP4:  # block scales tiled by each element's own tokens
        return None
    if backward and "sinks" in given:
        return None
    values = [field for field in given if layouts[field] in (VALUES, STACKED, ROWS)]
    if not all(batched[field] for field in values):
        return None
    v, options = given[values[0]], cfg.options
    if layouts[values[0]] is VALUES:
        tokens = v.shape[-3]
        cut = getattr(options, "merge_tokens", None)
        if cut is not None:  # it counts each element's own tokens: one inside them cannot fold
            if cut < tokens:
                return None
            options = options._replace(merge_tokens=None)
        return _Fold(size, tokens, options)
    if layouts[values[0]] is STACKED:
        if cfg.layout(values[0]) == "tn":
            tokens, states = v.shape[1:3]
            order = "tn"
        else:
            states, tokens = v.shape[1:3]
            if tokens == 1:  # [B, N, 1, H, D] is token-major [T' = B, N, H, D]
                order = "tn"
            elif states == 1:
                order = "nt"
            else:  # folding would copy every value
                return None
        return _Fold(size, tokens, options, stacked=(tuple(v.shape[1:]), order))
    return _ragged_fold(cfg, size, batched, given, v)


def _ragged_fold(cfg: _Config, size: int, batched: dict, given: dict, v: Any) -> _Fold | None:
    """The batches' rows back to back, each element's offsets shifted by its first row, and one
    extra token a batch element spanning the rows between its last offset and the next one's
    first. Offsets an element's own rows do not cover give NaN, as unbatched. Gradients: the rows
    no valid token owns (the extra tokens' included) are handed to the kernel with empty LSEs,
    so they get zero gradients whatever their values hold; an element of more rows than a token
    may have states keeps its own launch (the kernel zeroes such a token's rows with one row of
    threads a head)."""
    jnp = _jax().jnp
    indptr, rows = given["indptr"], v.shape[1]
    tokens = indptr.shape[-1] - 1
    backward = cfg.operation.is_backward
    if tokens == 0 or (indptr.dtype == numpy.int32 and size * rows >= 2**31 - 1):  # int32 offsets overflow
        return None
    if cfg.scales_aliased or (backward and rows > MAX_STATES_PER_TOKEN):
        return None
    indptr = _broadcast(indptr, batched["indptr"], size)
    begin, end = indptr[:, :-1], indptr[:, 1:]
    valid = (begin >= 0) & (end >= begin) & (end <= rows)
    shifted = jnp.clip(indptr, 0, rows) + (jnp.arange(size, dtype=indptr.dtype) * rows)[:, None]
    offsets = jnp.concatenate([shifted.reshape(-1), jnp.full((1,), size * rows, indptr.dtype)])
    owned = None
    if backward:  # the gradients' own rule of validity
        batch = jnp.arange(size)[:, None]
        edges = jnp.zeros((size, rows + 1), jnp.int32)
        edges = edges.at[batch, jnp.where(valid, begin, rows)].add(1).at[batch, jnp.where(valid, end, rows)].add(-1)
        owned = jnp.cumsum(edges, axis=1)[:, :rows] > 0
    else:
        valid = valid & (end - begin <= MAX_STATES_PER_TOKEN)
    return _Fold(size, tokens, cfg.options, ragged=_Ragged(rows, offsets, valid, owned))


def _fold_operand(fold: _Fold, layout: str, field: str, order: str, x: Any, batched: bool) -> tuple[Any, str]:
    """One operand of the batch as the folded call takes it, and its order there."""
    jnp = _jax().jnp
    size, ragged = fold.size, fold.ragged
    if layout in (PER_HEAD, SCALAR):
        return x, order
    if layout is OFFSETS:
        assert ragged is not None
        return ragged.offsets, order
    x = _broadcast(x, batched, size)
    if layout is ROWS:
        return x.reshape(size * x.shape[1], *x.shape[2:]), order
    if layout is ROW_LSE:
        if ragged is not None and ragged.owned is not None:
            x = jnp.where(ragged.owned[:, :, None] if order == "th" else ragged.owned[:, None, :], x, -jnp.inf)
        return _lse_token_major(x, order, size), "th"
    if layout is STACKED:
        shape, folded_order = fold.stacked
        states, tokens = (shape[1], shape[0]) if order == "tn" else shape[:2]
        if folded_order == "nt":  # one state: [B, 1, T, H, D] -> [1, B * T, H, D]
            return x.reshape(1, size * tokens, *shape[2:]), "nt"
        return x.reshape(size * tokens, states, *shape[2:]), "tn"
    if layout is STACKED_LSE:  # [B, N, H, T] or [B, T, N, H] -> [B * T, N, H]
        if order != "tnh":
            x = jnp.moveaxis(x, 3, 1)
        return x.reshape(size * x.shape[1], *x.shape[2:]), "tnh"
    # [B, T, ...] values, other token rows and LSEs
    if ragged is not None:  # the extra token a batch element
        if field == "merged_lse":  # offsets out of range merged to NaN; folded, their rows are -inf
            x = jnp.where(ragged.valid[:, :, None] if order == "th" else ragged.valid[:, None, :], x, -jnp.inf)
        x = _pad_token(x, order if layout is LSE else "th")
    if layout is LSE:
        return _lse_token_major(x, order, size), "th"
    return x.reshape(size * x.shape[1], *x.shape[2:]), order


def _unfold_result(fold: _Fold, layout: str, order: str, x: Any) -> Any:
    """One result of the folded call as the batch of results (``order``: the batch's own)."""
    jnp = _jax().jnp
    size, ragged = fold.size, fold.ragged
    if layout is STACKED:
        return x.reshape(size, *fold.stacked[0])
    if layout is STACKED_LSE:  # [B * T, N, H] -> [B, T, N, H] or [B, N, H, T]
        x = x.reshape(size, fold.tokens, *x.shape[1:])
        return x if order == "tnh" else jnp.moveaxis(x, 1, 3)
    if layout is ROWS:  # (sizes, not -1 or a division: a batch of none, or rows of no heads, is empty)
        assert ragged is not None
        return x.reshape(size, ragged.rows, *x.shape[1:])
    if layout is ROW_LSE:
        assert ragged is not None
        return _lse_unfold(x, size, ragged.rows, order)
    if ragged is None:
        x = x.reshape(size, fold.tokens, *x.shape[1:])
    else:  # the extra tokens dropped; tokens of offsets out of range NaN, as unbatched
        x = x.reshape(size, fold.tokens + 1, *x.shape[1:])[:, : fold.tokens]
        x = jnp.where(ragged.valid.reshape(*ragged.valid.shape, *(1,) * (x.ndim - 2)), x, jnp.nan)
    if layout is LSE:
        return _lse_unfold(x.reshape(size * fold.tokens, x.shape[-1]), size, fold.tokens, order)
    return x


def _broadcast(x: Any, batched: bool, size: int) -> Any:
    return x if batched else _jax().jnp.broadcast_to(x, (size, *x.shape))


def _lse_token_major(x: Any, layout: str, size: int) -> Any:
    """A batch of 2-D LSEs ([B, H, T] "ht" or [B, T, H] "th") as one token-major [B * T, H] buffer:
    free for "th" and for one token; a transpose of the (small) LSE otherwise."""
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


def _pad_token(x: Any, layout: str) -> Any:
    """One more token of zeros at the end of each batch element's token axis."""
    axis = {"th": 1, "ht": 2}.get(layout, 1)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, 1)
    return _jax().jnp.pad(x, widths)
