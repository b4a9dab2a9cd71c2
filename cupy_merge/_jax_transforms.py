"""cupy_merge.jax, the transformations: the traced merge behind its batching rule (``vmap``:
``_jax_batching``, from the operands' layouts), its derivative (a ``custom_vjp`` whose backward is
the merge's backward kernel, batched alike), and the types ``shard_map`` checks (the mesh axes each
result varies over)."""

from __future__ import annotations

import functools
import operator
from typing import Any

import numpy

from . import _dispatch, _jax_batching, _options, _tuning
from ._catalogue import FP8, NVFP4
from ._jax_launch import CACHE_LIMIT, _build_backward_entry, _Config, _Entry, _entry, _jax, natural_orders
from ._ops import MERGE_STATE_BACKWARD, MERGE_STATES_BACKWARD, MERGE_STATES_VARLEN_BACKWARD

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


@functools.lru_cache(maxsize=CACHE_LIMIT)
def _batched(cfg: _Config):
    """The merge (or backward merge) of ``cfg`` with its batching rule (``jax.custom_batching.custom_vmap``)."""
    jax = _jax().jax
    raw = _raw_backward if cfg.operation.is_backward else _raw

    def merge(*arrays):
        return raw(cfg, arrays)

    function = jax.custom_batching.custom_vmap(merge)
    function.def_vmap(functools.partial(_jax_batching.rule, _batched, cfg))
    return function


@functools.lru_cache(maxsize=CACHE_LIMIT)
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
    if cfg.options.out_dtype in (FP8, NVFP4):
        kind = "an FP8 (float8_e4m3fn)" if cfg.options.out_dtype == FP8 else "an NVFP4 (float4_e2m1fn_x2)"
        raise TypeError(
            f"cupy_merge.jax.{cfg.operation.name}: {kind} output is not differentiable; merge to "
            f"float32, float16 or bfloat16 to take gradients through the merge (and quantise after it), or "
            f"apply jax.lax.stop_gradient to its inputs"
        )
    results = _once_differentiable(cfg)(*arrays)
    return results, (arrays, tuple(results[:2]) if cfg.operation.many else None)


@functools.lru_cache(maxsize=CACHE_LIMIT)
def _once_differentiable(cfg: _Config):
    """:func:`_batched` as the custom_vjp's forward and backward call it: a derivative of either would
    be a second derivative of the merge (``jax.grad`` of ``jax.grad``), refused clearly."""
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
    cfg = _Config(operation, options, tuning, fields, natural_orders(operation, fields))
    return tuple(_once_differentiable(cfg)(*(values[field] for field in fields)))


def _no_second_derivative(name: str, primals: Any, tangents: Any) -> Any:
    merge = name.removesuffix("_backward")
    raise NotImplementedError(
        f"cupy_merge.jax.{merge}: merges are differentiable once; the gradient of a merge is not "
        f"differentiable again (jax.grad of jax.grad, jax.hessian, forward mode over a gradient are refused "
        f"rather than wrong)"
    )


def _raw_backward(cfg: _Config, arrays: tuple) -> tuple:
    """One backward merge on the traced ``arrays`` (``cfg.fields`` order, in ``cfg.layouts``)."""
    jnp = _jax().jnp
    avals = tuple((tuple(x.shape), numpy.dtype(x.dtype)) for x in arrays)
    entry = _entry(cfg, avals, _build_backward_entry)
    kept = len(entry.results) - entry.scratch
    if entry.call is None:
        return tuple(jnp.zeros(shape, dtype) for shape, dtype in entry.results[:kept])
    return _varying(tuple(entry.call(*arrays))[:kept], arrays)
