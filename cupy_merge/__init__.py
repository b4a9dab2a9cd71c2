"""Merge partial attention states on the GPU.

>>> import cupy_merge as cm
>>> v, s = cm.merge_state(v_a, s_a, v_b, s_b)          # doctest: +SKIP
>>> cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)  # doctest: +SKIP
"""

from . import reference
from ._kernels import KernelCompileError
from .merge import merge_attn_states, merge_state

__version__ = "0.1.0"

__all__ = ["KernelCompileError", "__version__", "merge_attn_states", "merge_state", "reference"]
