"""Merge partial attention states on the GPU.

>>> import cupy_merge as cm
>>> v, s = cm.merge_state(v_a, s_a, v_b, s_b)          # doctest: +SKIP
>>> cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)  # doctest: +SKIP
>>> v, s = cm.merge_states(v_splits, s_splits)               # doctest: +SKIP
>>> merge = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b)  # doctest: +SKIP
>>> merge()  # relaunch on the same arrays: the cheapest call   # doctest: +SKIP
"""

try:
    import cupy  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != "cupy":
        raise
    raise ImportError(
        "cupy_merge needs CuPy: pip install 'cupy-merge[cu12]' (CUDA 12) or 'cupy-merge[cu13]' (CUDA 13)"
    ) from None

from . import distributed, reference
from ._kernels import KernelCompileError
from .bound import BoundMerge, bind
from .merge import merge_attn_states, merge_state, merge_state_in_place
from .merge_many import merge_states, merge_states_varlen

__version__ = "0.3.0"

__all__ = [
    "BoundMerge",
    "KernelCompileError",
    "__version__",
    "bind",
    "distributed",
    "merge_attn_states",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "merge_states_varlen",
    "reference",
]
