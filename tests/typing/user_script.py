"""A user's script, type-checked by tests/test_typing.py: results keep the type of the inputs."""

import torch

import cupy_merge as cm
from cupy_merge.types import LseBase

v_a = torch.zeros(4, 2, 8, device="cuda")
s_a = torch.zeros(2, 4, device="cuda")
base: LseBase = 2

v, s = cm.merge_state(v_a, s_a, v_a, s_a, lse_base=base)
print(v.float().sum(), s.exp())  # torch.Tensor methods: the result is typed as a tensor

merged, lse = cm.merge_states(v_a[None], s_a[None])
print(merged.half(), lse.T.contiguous())

grad_v, grad_s, grad_sinks = cm.merge_states_backward(v_a[None], s_a[None], v)
print(grad_v.sum(), grad_s.sum(), grad_sinks is None)

step = cm.bind(cm.merge_attn_states, v_a, v_a, s_a, v_a, s_a)
step()
step(stream=torch.cuda.current_stream())
