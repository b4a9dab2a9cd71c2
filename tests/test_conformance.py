"""The conformance matrix's CPU part, for CI: the cells that run on stand-ins without a GPU.

torch.compile (aot_eager) and torch.export over CPU tensors, with the float64 reference registered as the ops'
CPU kernels (test_torch_ops.py's stand-in), and the JAX merges eagerly, under jit, vmap and
grad on JAX's CPU device, with the kernels' launch replaced by the NumPy stand-in of
test_jax.py (vmap with each operand batched or shared, at axis 1, nested, lax.scan, vmap of the
VJP, shard_map of the merge and of the VJP): every declaration, sinks or none, base e or 2, FP8 where taken, against the float64
reference. They check what the integrations derive from the declarations (arguments, options,
layouts, results and gradients passed through), not the kernels: those are the GPU matrix's.
"""

from __future__ import annotations

import pytest
from conformance import case_id, cases, refused_cases

pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("jax.experimental.buffer_callback")

from test_gpu_conformance import JAX_BATCH_WAYS, run_forward, run_gradients, run_refused
from test_jax import numpy_kernels  # noqa: F401 - the fixture
from test_torch_ops import _cpu_library, cpu_kernels  # noqa: F401 - the fixtures

#: The JAX batch ways beyond plain vmap: 90 s on two cores, in CI's exhaustive pass (every one on the GPU).
HEAVY = {"jax.vmap each", "jax.vmap axis 1", "jax.vmap nested", "jax.scan", "jax.vmap grad"}


def _cells(ways: list[str], differentiable: bool = False) -> list:
    return [pytest.param(cell, marks=pytest.mark.exhaustive) if cell[2] in HEAVY else cell
            for cell in cases(ways, differentiable)]  # fmt: skip


@pytest.mark.parametrize("cell", _cells(["torch.compile", "torch.export", "jax", "jax.jit", *JAX_BATCH_WAYS, "jax.shard_map"]),
                         ids=case_id)  # fmt: skip
def test_every_merge_through_the_integrations_follows_the_reference(cpu_kernels, numpy_kernels, rng, cell):  # noqa: F811
    run_forward(cell, rng, device="cpu")


@pytest.mark.parametrize("cell", _cells(["torch.autograd compiled", "jax.grad", "jax.vmap grad", "jax.shard_map grad"],
                                        differentiable=True),
                         ids=case_id)  # fmt: skip
def test_every_differentiable_merge_through_the_integrations_gives_the_reference_gradients(
    cpu_kernels, numpy_kernels, rng, cell  # noqa: F811
):
    run_gradients(cell, rng, device="cpu")


@pytest.mark.parametrize("cell", refused_cases(["torch.autograd compiled", "jax.grad", "jax.shard_map grad"]), ids=case_id)
def test_every_refused_cell_is_refused_with_a_clear_error(cpu_kernels, numpy_kernels, rng, cell):  # noqa: F811
    run_refused(cell, rng, device="cpu")
