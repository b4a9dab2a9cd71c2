"""The conformance matrix on a GPU: every merge x every way of calling it x sinks, LSE base, FP8,
each against the float64 reference (cells generated from the declarations: tests/conformance.py)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conformance import (
    FP8,
    REFUSED,
    SCALE,
    case_id,
    cases,
    expect_close,
    expect_merged,
    inputs,
    public_arguments,
    reference_gradients,
    reference_merge,
    refused_cases,
    takes,
)

import cupy_merge as cm
from cupy_merge import _ops

pytestmark = pytest.mark.gpu

#: The JAX ways over a batch of draws: vmap (each operand batched, then each in turn flipped:
#: shared by the batch, or the sinks and scale one a batch element), vmap at axis 1, nested vmap,
#: lax.scan; for gradients, vmap of the VJP with each operand flipped in turn.
JAX_BATCH_WAYS = ["jax.vmap", "jax.vmap each", "jax.vmap axis 1", "jax.vmap nested", "jax.scan"]
#: shard_map over every device of JAX's default platform: a draw a device, the sinks and scale
#: replicated (their gradients summed over the devices); under jit, with JAX's varying-axes checks.
FORWARD_WAYS = ["cupy", "torch", "bind", "torch.compile", "torch.export", "jax", "jax.jit", *JAX_BATCH_WAYS,
                "jax.shard_map"]  # fmt: skip
GRADIENT_WAYS = ["torch.autograd", "torch.autograd compiled", "jax.grad", "jax.vmap grad", "jax.shard_map grad"]
#: Operands a batch shares unless a pattern gives them one a batch element.
SHARED_BY_DEFAULT = ("sinks", "output_scale")


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


def _batch_patterns(operation, variant, arrays, way: str) -> list[frozenset]:
    """Which array arguments are batched: all but the sinks and scale, and with ``each`` that
    pattern with each argument in turn flipped."""
    _, kwargs = _jax_call(operation, variant, arrays)
    names = [name for name, value in kwargs.items() if hasattr(value, "shape")]
    default = frozenset(name for name in names if name not in SHARED_BY_DEFAULT)
    return [default ^ {name} for name in names] if way.endswith("each") else [default]


#: The token axis of each layout that has one.
_TOKEN_AXIS = {_ops.STACKED: 1, _ops.STACKED_LSE: 2, _ops.TOKENS: 0, _ops.LSE: 1}


def _geometries(operation) -> list:
    """Functions of a draw: itself and, where the operation stacks its states (whose batch folds
    for free only with one token or one state), its one-token and one-state slices."""
    layouts = {**(operation.backward.layouts if operation.backward else {}), **operation.layouts}

    def one_token(arrays):
        return {f: x.take([0], _TOKEN_AXIS[layouts[f]]) if layouts[f] in _TOKEN_AXIS else x for f, x in arrays.items()}

    def one_state(arrays):
        return {f: x[:1] if layouts[f] in (_ops.STACKED, _ops.STACKED_LSE) else x for f, x in arrays.items()}

    return [lambda arrays: arrays] + ([one_token, one_state] if _ops.STACKED in layouts.values() else [])


def _draws(geometry, first: dict, fresh, size: int, batched: frozenset, names: dict) -> list[dict]:
    """``first`` and ``size - 1`` draws from ``fresh()``, in ``geometry``, the operands not batched shared."""
    first = geometry(first)
    draws = [first]
    for _ in range(size - 1):
        draw = geometry(fresh())
        draws.append({field: draw[field] if names[field] in batched else x for field, x in first.items()})
    return draws


def _run_jax_batched(operation, variant, arrays, rng, way):
    """A forward cell over a batch of draws (``JAX_BATCH_WAYS``), each element against its reference."""
    import jax
    import jax.numpy as jnp

    names = {field: getattr(operation.names, field) for field in arrays}
    for geometry, batched in itertools.product(_geometries(operation), _batch_patterns(operation, variant, arrays, way)):
        function, kwargs = _jax_call(operation, variant, geometry(arrays))
        size = 4 if way == "jax.vmap nested" else 2
        draws = _draws(geometry, arrays, lambda: inputs(operation, variant, rng), size, batched, names)
        calls = [_jax_call(operation, variant, draw)[1] for draw in draws]
        static = {name: value for name, value in kwargs.items() if name not in batched}
        axis = 1 if way == "jax.vmap axis 1" else 0
        stacked = {name: jnp.stack([call[name] for call in calls], axis=axis) for name in batched}

        def merge(xs, function=function, static=static):
            return function(**xs, **static)

        if way == "jax.vmap nested":
            nested = {name: x.reshape(2, 2, *x.shape[1:]) for name, x in stacked.items()}
            results = [r.reshape(4, *r.shape[2:]) for r in jax.vmap(jax.vmap(merge))(nested)]
        elif way == "jax.scan":
            results = jax.lax.scan(lambda carry, xs: (carry, merge(xs)), None, stacked)[1]
        else:
            results = jax.vmap(merge, in_axes=axis)(stacked)
        for element, draw in enumerate(draws):
            what = f"batched {sorted(batched)}, element {element}, shapes {[x.shape for x in draw.values()]}"
            try:
                expect_merged(_jax_host(results[0][element]), _jax_host(results[1][element]),
                              reference_merge(operation, variant, draw), variant)  # fmt: skip
            except AssertionError as error:
                raise AssertionError(f"{what}: {error}") from None


def _shard_map(function, in_specs, out_specs):
    """``jax.shard_map`` (``jax.experimental.shard_map`` before JAX 0.7) of ``function`` over a mesh
    of every device of JAX's default platform (the CPU stand-in's ``jax.default_device`` platform
    where it is set: on a GPU machine the CPU part would shard over the GPUs), axis ``x``, under
    ``jax.jit``."""
    import jax
    from jax.sharding import Mesh

    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:
        from jax.experimental.shard_map import shard_map
    platform = getattr(getattr(jax.config, "jax_default_device", None), "platform", None)
    mesh = Mesh(np.array(jax.devices(platform)), ("x",))
    return jax.jit(shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs)), mesh.size


def _sharded(names, shared) -> tuple:
    """Partition specs of the arguments ``names``: split along ``x``, or replicated when ``shared``."""
    from jax.sharding import PartitionSpec

    return tuple(PartitionSpec() if name in shared else PartitionSpec("x") for name in names)


def _run_jax_sharded(operation, variant, arrays, rng):
    """A forward cell inside shard_map: one draw a device (each array split along the mesh, the
    sinks and scale replicated), each device's merge against its draw's reference."""
    import jax.numpy as jnp

    function, kwargs = _jax_call(operation, variant, arrays)
    names = [name for name, value in kwargs.items() if hasattr(value, "shape")]
    static = {name: value for name, value in kwargs.items() if name not in names}

    def local(*xs):
        given = {name: x if name in SHARED_BY_DEFAULT else x[0] for name, x in zip(names, xs)}
        merged, lse = function(**given, **static)[:2]
        return merged[None], lse[None]

    from jax.sharding import PartitionSpec

    sharded, devices = _shard_map(local, _sharded(names, SHARED_BY_DEFAULT), (PartitionSpec("x"),) * 2)
    draws = [arrays] + [dict(inputs(operation, variant, rng), **{f: arrays[f] for f in SHARED_BY_DEFAULT if f in arrays})
                        for _ in range(devices - 1)]  # fmt: skip
    calls = [_jax_call(operation, variant, draw)[1] for draw in draws]
    stacked = [calls[0][name] if name in SHARED_BY_DEFAULT else jnp.stack([call[name] for call in calls]) for name in names]
    merged, lse = sharded(*stacked)
    for element, draw in enumerate(draws):
        try:
            expect_merged(_jax_host(merged[element]), _jax_host(lse[element]), reference_merge(operation, variant, draw),
                          variant)  # fmt: skip
        except AssertionError as error:
            raise AssertionError(f"device {element} of {devices}: {error}") from None


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


@pytest.mark.parametrize("cell", refused_cases(GRADIENT_WAYS), ids=case_id)
def test_every_refused_cell_is_refused_with_a_clear_error(rng, cell):
    run_refused(cell, rng)


def run_refused(cell, rng, device="cuda"):
    """A gradient cell that cannot work (``REFUSED``): differentiating it raises before anything is
    written, with a message that says why."""
    operation, variant, way = cell
    arrays = inputs(operation, variant, rng)
    words = "|".join(rule.words for rule in REFUSED if way in rule.ways and rule.applies(operation, variant))
    if way.startswith("torch"):
        torch = pytest.importorskip("torch")
        make, nan_like, _ = _torch_kind(device)
        kwargs, _ = public_arguments(operation, variant, arrays, lambda x: make(x).requires_grad_(x.dtype != np.int32),
                                     nan_like, make(np.array([SCALE], np.float32)))  # fmt: skip
        merge = operation.function
        if way.endswith("compiled"):
            torch._dynamo.reset()
            compiled = torch.compile(lambda kw: operation.function(**kw), fullgraph=True,
                                     backend="inductor" if device == "cuda" else "aot_eager")  # fmt: skip

            def merge(**kw):
                return compiled(kw)

        with pytest.raises(Exception, match=words):
            merge(**kwargs)
    else:
        jax = pytest.importorskip("jax")
        if device == "cuda" and jax.devices()[0].platform != "gpu":
            pytest.skip("JAX has no CUDA device here")
        function, kwargs = _jax_call(operation, variant, arrays)
        primal = next(name for name, value in kwargs.items() if hasattr(value, "shape") and value.dtype != np.int32)

        def loss(x):
            return function(**dict(kwargs, **{primal: x}))[1].sum()

        if way == "jax.shard_map grad":
            from jax.sharding import PartitionSpec

            loss, _ = _shard_map(loss, PartitionSpec(), PartitionSpec())
        with pytest.raises(Exception, match=words):
            jax.grad(loss)(kwargs[primal])


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
        elif way == "jax.shard_map":
            return _run_jax_sharded(operation, variant, arrays, rng)
        else:
            return _run_jax_batched(operation, variant, arrays, rng, way)
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

        if way == "jax.vmap grad":
            return _run_jax_vmapped_gradients(operation, variant, dict(arrays, grad_out=grad_out, grad_lse=grad_lse), rng)
        if way == "jax.shard_map grad":
            return _run_jax_sharded_gradients(operation, variant, dict(arrays, grad_out=grad_out, grad_lse=grad_lse), rng)
        given = {field: jnp.asarray(x) for field, x in dict(arrays, grad_out=grad_out, grad_lse=grad_lse).items()}
        grads = jax.jit(lambda at: _element_vjp(operation, variant, at))(given)
        got = {field: np.asarray(grad, np.float64) for field, grad in zip(differentiable, grads)}
    assert set(got) == set(want)
    for field in differentiable:
        expect_close(got[field], want[field], 1e-5, f"gradient of {field}")


def _element_vjp(operation, variant, given: dict) -> tuple:
    """The VJP of one element's merge (``cupy_merge.jax``) at ``given``, its operands and the
    cotangents ``grad_out`` and ``grad_lse`` by field: the gradients of its differentiable operands."""
    import jax

    import cupy_merge.jax as cmj

    names = operation.names
    differentiable = [field for field in operation.gradients if field in given]
    held = {getattr(names, f): x for f, x in given.items() if f not in differentiable and not f.startswith("grad_")}
    if takes(operation, "check_indptr"):
        held["check_indptr"] = False
    function = getattr(cmj, operation.name)

    def merge(*primals):
        kwargs = {getattr(names, f): x for f, x in zip(differentiable, primals)}
        return function(**kwargs, **held, lse_base=variant.lse_base)

    return jax.vjp(merge, *(given[f] for f in differentiable))[1]((given["grad_out"], given["grad_lse"]))


def _fresh_with_cotangents(operation, variant, arrays: dict, rng):
    """Another draw of the operands and cotangents of ``arrays``' shapes."""
    cotangents = {f: rng.standard_normal(arrays[f].shape).astype(np.float32) for f in ("grad_out", "grad_lse")}
    return dict(inputs(operation, variant, rng), **cotangents)


def _run_jax_vmapped_gradients(operation, variant, arrays, rng):
    """vmap of the VJP over a batch of two draws (operands and cotangents), every operand batched
    but the sinks, then each in turn flipped; each element's gradients against its reference."""
    import jax
    import jax.numpy as jnp

    differentiable = [field for field in operation.gradients if field in arrays]
    fields = list(arrays)

    def element(*xs):
        return _element_vjp(operation, variant, dict(zip(fields, xs)))

    def fresh():
        return _fresh_with_cotangents(operation, variant, arrays, rng)

    default = frozenset(field for field in fields if field not in SHARED_BY_DEFAULT)
    for geometry, batched in itertools.product(_geometries(operation), [default ^ {field} for field in fields]):
        draws = _draws(geometry, arrays, fresh, 2, batched, {field: field for field in fields})
        args = [jnp.stack([draw[f] for draw in draws]) if f in batched else jnp.asarray(draws[0][f]) for f in fields]
        grads = jax.jit(jax.vmap(element, in_axes=[0 if f in batched else None for f in fields]))(*args)
        for index, draw in enumerate(draws):
            want = reference_gradients(operation, variant, draw, draw["grad_out"], draw["grad_lse"])
            for field, grad in zip(differentiable, grads):
                expect_close(np.asarray(grad[index], np.float64), want[field], 1e-5,
                             f"gradient of {field}, batched {sorted(batched)}, element {index}, shapes {[x.shape for x in draw.values()]}")  # fmt: skip


def _run_jax_sharded_gradients(operation, variant, arrays, rng):
    """The VJP inside shard_map: one draw (operands and cotangents) a device, the sinks replicated
    (their gradient summed over the devices, as JAX's varying-axes types require); each device's
    gradients against its draw's reference."""
    import jax.numpy as jnp

    differentiable = [field for field in operation.gradients if field in arrays]
    fields = list(arrays)

    def local(*xs):
        grads = _element_vjp(operation, variant, {f: x if f in SHARED_BY_DEFAULT else x[0] for f, x in zip(fields, xs)})
        return tuple(grad if f in SHARED_BY_DEFAULT else grad[None] for f, grad in zip(differentiable, grads))

    sharded, devices = _shard_map(local, _sharded(fields, SHARED_BY_DEFAULT), _sharded(differentiable, SHARED_BY_DEFAULT))

    def fresh():
        return _fresh_with_cotangents(operation, variant, arrays, rng)

    draws = [arrays] + [dict(fresh(), **{f: arrays[f] for f in SHARED_BY_DEFAULT if f in arrays}) for _ in range(devices - 1)]
    args = [jnp.asarray(arrays[f]) if f in SHARED_BY_DEFAULT else jnp.stack([draw[f] for draw in draws]) for f in fields]
    grads = dict(zip(differentiable, sharded(*args)))
    wants = [reference_gradients(operation, variant, draw, draw["grad_out"], draw["grad_lse"]) for draw in draws]
    for field in differentiable:
        if field in SHARED_BY_DEFAULT:  # replicated: the devices' gradients summed
            expect_close(np.asarray(grads[field], np.float64), sum(want[field] for want in wants), 1e-5,
                         f"gradient of {field} over {devices} devices")  # fmt: skip
            continue
        for index, want in enumerate(wants):
            expect_close(np.asarray(grads[field][index], np.float64), want[field], 1e-5,
                         f"gradient of {field}, device {index} of {devices}")  # fmt: skip
