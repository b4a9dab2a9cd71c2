"""The conformance matrix on a GPU: every merge x every way of calling it x sinks, LSE base, FP8,
each against the float64 reference (cells generated from the declarations: tests/conformance.py)."""

from __future__ import annotations

import numpy as np
import pytest
from conformance import (
    FP8,
    SCALE,
    case_id,
    cases,
    expect_close,
    expect_merged,
    inputs,
    public_arguments,
    reference_gradients,
    reference_merge,
    takes,
)

import cupy_merge as cm

pytestmark = pytest.mark.gpu

FORWARD_WAYS = ["cupy", "torch", "bind", "torch.compile", "torch.export", "jax", "jax.jit", "jax.vmap"]
GRADIENT_WAYS = ["torch.autograd", "torch.autograd compiled", "jax.grad"]


# -- array kinds -------------------------------------------------------------------------------------------


def _cupy_kind():
    import cupy

    from cupy_merge import _arrays

    def nan_like(shape, dtype):
        if dtype == FP8:
            return cupy.full(shape, 0x7F, dtype=cupy.uint8).view(_arrays.cupy_dtype(FP8))  # FP8 NaN
        return cupy.full(shape, np.nan, dtype=dtype)

    def host(x):
        x = cupy.asnumpy(x)
        if x.dtype == np.uint8:
            import ml_dtypes

            x = x.view(ml_dtypes.float8_e4m3fn)
        return x.astype(np.float64)

    return cupy.asarray, nan_like, host


def _torch_kind(device="cuda"):
    torch = pytest.importorskip("torch")

    def nan_like(shape, dtype):
        return torch.full(shape, float("nan"), device=device).to(getattr(torch, dtype))

    def host(x):
        return x.detach().float().cpu().double().numpy()

    return (lambda x: torch.from_numpy(x).to(device)), nan_like, host


def _forward(operation, variant, arrays, kind, call):
    make, nan_like, host = kind
    kwargs, written = public_arguments(operation, variant, arrays, make, nan_like, make(np.array([SCALE], np.float32)))
    results = call(operation.function, kwargs)
    if written:
        results = (written["out"], written["out_lse"])
    return host(results[0]), host(results[1])


# -- JAX ------------------------------------------------------------------------------------------------


def _jax_call(operation, variant, arrays, traced=True):
    """The cupy_merge.jax function of the operation and its keyword arguments (JAX merges return
    what the writing forms write; traced offsets cannot be checked on the host)."""
    import jax.numpy as jnp

    import cupy_merge.jax as cmj

    kwargs, written = public_arguments(operation, variant, arrays, jnp.asarray, lambda shape, dtype: None,
                                       jnp.asarray([SCALE], jnp.float32))  # fmt: skip
    names = operation.names
    for field in written:
        name = getattr(names, field)
        if not any(getattr(names, other) == name for other in names._fields if other not in written):
            kwargs.pop(name)
    if variant.fp8:
        kwargs["out_dtype"] = FP8
    if traced and takes(operation, "check_indptr"):
        kwargs["check_indptr"] = False
    return getattr(cmj, operation.name), kwargs


def _jax_host(x):
    import jax.numpy as jnp

    return np.asarray(jnp.asarray(x).astype(jnp.float32)).astype(np.float64)


# -- the forward matrix ----------------------------------------------------------------------------------


def _torch_exported(function, kwargs):
    """``torch.export`` of a module that merges its tensor arguments, then the exported program run."""
    import torch

    names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    constants = {name: value for name, value in kwargs.items() if name not in names}

    class Merge(torch.nn.Module):
        def forward(self, *tensors):
            return function(**dict(zip(names, tensors)), **constants)

    program = torch.export.export(Merge(), tuple(kwargs[name] for name in names))
    return program.module()(*(kwargs[name] for name in names))


def _torch_compiled(function, kwargs, backend="inductor"):
    import torch

    torch._dynamo.reset()
    return torch.compile(lambda arguments: function(**arguments), fullgraph=True, backend=backend)(kwargs)


@pytest.mark.parametrize("cell", cases(FORWARD_WAYS), ids=case_id)
def test_every_merge_every_way_follows_the_reference(rng, cell):
    run_forward(cell, rng)


@pytest.mark.parametrize("cell", cases(GRADIENT_WAYS, differentiable=True), ids=case_id)
def test_every_differentiable_merge_every_way_gives_the_reference_gradients(rng, cell):
    run_gradients(cell, rng)


def run_forward(cell, rng, device="cuda"):
    """One forward cell (``device="cpu"``: the ways that run on CPU stand-ins, for CI)."""
    operation, variant, way = cell
    backend = "inductor" if device == "cuda" else "aot_eager"
    arrays = inputs(operation, variant, rng)
    want = reference_merge(operation, variant, arrays)
    if way == "cupy":
        got = _forward(operation, variant, arrays, _cupy_kind(), lambda f, kw: f(**kw))
    elif way == "torch":
        got = _forward(operation, variant, arrays, _torch_kind(), lambda f, kw: f(**kw))
    elif way == "bind":
        got = _forward(operation, variant, arrays, _torch_kind(), lambda f, kw: cm.bind(f, **kw)())
    elif way == "torch.export":
        got = _forward(operation, variant, arrays, _torch_kind(device), _torch_exported)
    elif way == "torch.compile":
        got = _forward(operation, variant, arrays, _torch_kind(device),
                       lambda f, kw: _torch_compiled(f, kw, backend))  # fmt: skip
    else:
        jax = pytest.importorskip("jax")
        if device == "cuda" and jax.devices()[0].platform != "gpu":
            pytest.skip("JAX has no CUDA device here")
        function, kwargs = _jax_call(operation, variant, arrays, traced=way != "jax")
        if way == "jax":
            got = function(**kwargs)
        elif way == "jax.jit":
            static = {name: value for name, value in kwargs.items() if not hasattr(value, "shape")}
            arrays_given = {name: value for name, value in kwargs.items() if hasattr(value, "shape")}
            got = jax.jit(lambda given: function(**given, **static))(arrays_given)
        else:  # jax.vmap over a batch of two: this draw and another, the sinks and scale shared
            other = dict(inputs(operation, variant, rng), **{f: arrays[f] for f in ("sinks",) if f in arrays})
            _, other_kwargs = _jax_call(operation, variant, other)
            batched = [name for name in kwargs if name not in ("sinks", "output_scale") and hasattr(kwargs[name], "shape")]
            static = {name: value for name, value in kwargs.items() if name not in batched}
            stacked = [jax.numpy.stack([kwargs[name], other_kwargs[name]]) for name in batched]
            results = jax.vmap(lambda *xs: function(**dict(zip(batched, xs)), **static))(*stacked)
            for element, draw in enumerate((arrays, other)):
                expect_merged(_jax_host(results[0][element]), _jax_host(results[1][element]),
                              reference_merge(operation, variant, draw), variant)  # fmt: skip
            return
        got = (_jax_host(got[0]), _jax_host(got[1]))
    expect_merged(*got, want, variant)


# -- the gradient matrix ---------------------------------------------------------------------------------


def run_gradients(cell, rng, device="cuda"):
    """One gradient cell (``device="cpu"``: on CPU stand-ins)."""
    operation, variant, way = cell
    arrays = inputs(operation, variant, rng)
    grad_out = rng.standard_normal((5, 4, 64)).astype(np.float32)
    grad_lse = rng.standard_normal((4, 5)).astype(np.float32)
    want = reference_gradients(operation, variant, arrays, grad_out, grad_lse)
    names = operation.names
    differentiable = [field for field in operation.gradients if field in arrays]
    if way.startswith("torch"):
        torch = pytest.importorskip("torch")
        tensors = {field: torch.from_numpy(x).to(device) for field, x in arrays.items()}
        for field in differentiable:
            tensors[field].requires_grad_()
        kwargs = {getattr(names, field): tensor for field, tensor in tensors.items()}

        def merge(arguments):
            return operation.function(**arguments, lse_base=variant.lse_base)

        if way.endswith("compiled"):
            torch._dynamo.reset()
            merge = torch.compile(merge, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        out, lse = merge(kwargs)
        grads = torch.autograd.grad((out, lse), [tensors[f] for f in differentiable],
                                    (torch.from_numpy(grad_out).to(device), torch.from_numpy(grad_lse).to(device)))  # fmt: skip
        got = {field: grad.double().cpu().numpy() for field, grad in zip(differentiable, grads)}
    else:
        jax = pytest.importorskip("jax")
        if device == "cuda" and jax.devices()[0].platform != "gpu":
            pytest.skip("JAX has no CUDA device here")
        import jax.numpy as jnp

        import cupy_merge.jax as cmj

        given = {field: jnp.asarray(x) for field, x in arrays.items()}
        fixed = {getattr(names, f): given[f] for f in given if f not in differentiable}
        if takes(operation, "check_indptr"):
            fixed["check_indptr"] = False
        function = getattr(cmj, operation.name)

        def merge(*primals):
            kwargs = {getattr(names, f): x for f, x in zip(differentiable, primals)}
            return function(**kwargs, **fixed, lse_base=variant.lse_base)

        def vjp(*primals):
            return jax.vjp(merge, *primals)[1]((jnp.asarray(grad_out), jnp.asarray(grad_lse)))

        grads = jax.jit(vjp)(*(given[f] for f in differentiable))
        got = {field: np.asarray(grad, np.float64) for field, grad in zip(differentiable, grads)}
    assert set(got) == set(want)
    for field in differentiable:
        expect_close(got[field], want[field], 1e-5, f"gradient of {field}")
