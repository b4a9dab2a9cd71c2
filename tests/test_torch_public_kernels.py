"""torch's Dynamo inside a forward-mode AD level, with the ops' CPU kernels being the public merges
(as their CUDA kernels are) over the dispatcher's stand-in. A module of its own: torch before 2.13
refuses a second Python kernel for one dispatch key, and test_torch_tracers.py's other tests hold
the float64 stand-in's (a module-scoped library) while they run."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_torch_ops import eager_stand_in  # noqa: F401 - the fixture
from test_torch_tracers import compiled, states

import cupy_merge as cm
from cupy_merge import torch_ops


@pytest.fixture
def public_kernels(eager_stand_in, monkeypatch):  # noqa: F811
    """The ops' CPU kernels are the public merges (as their CUDA kernels are), over the dispatcher's stand-in."""
    monkeypatch.setattr(torch_ops, "_SPECS_ON_HOST", True)
    lib = torch.library.Library(torch_ops.NAMESPACE, "FRAGMENT")
    for name, op in torch_ops._TORCH_OPS.items():
        lib.impl(name, torch_ops._kernel(op), "CPU")
    yield eager_stand_in
    lib._destroy()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_dual_tensor_under_torch_compile_is_refused(public_kernels, rng, fullgraph):
    """Traced, a tangent cannot be seen (fake tensors carry none): a merge traced inside a dual level
    is refused; without fullgraph Dynamo then runs it eagerly, where the dual tensor is named."""
    import torch.autograd.forward_ad as fwAD

    v_a, s_a, v_b, s_b = states(rng)
    merge = compiled(lambda *a: cm.merge_state(*a), fullgraph)
    with fwAD.dual_level():
        dual = fwAD.make_dual(v_a, torch.ones_like(v_a))
        words = "forward-mode AD level" if fullgraph else "v_a: a dual tensor of forward-mode AD"
        with pytest.raises(Exception, match=words):
            merge(dual, s_a, v_b, s_b)
        assert not public_kernels  # nothing ran
