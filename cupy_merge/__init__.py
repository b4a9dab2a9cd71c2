"""Merge partial attention states on the GPU.

>>> import cupy_merge as cm
>>> v, s = cm.merge_state(v_a, s_a, v_b, s_b)          # doctest: +SKIP
>>> cm.merge_attn_states(out, v_a, s_a, v_b, s_b, out_lse)  # doctest: +SKIP
>>> v, s = cm.merge_states(v_splits, s_splits)               # doctest: +SKIP
>>> merge = cm.bind(cm.merge_attn_states, out, v_a, s_a, v_b, s_b)  # doctest: +SKIP
>>> merge()  # relaunch on the same arrays: the cheapest call   # doctest: +SKIP
"""

import os as _os
import sys as _sys

from ._version import __version__

#: What to install when CuPy is missing, in one line.
CUPY_HINT = (
    "cupy_merge needs CuPy: pip install 'cupy-cuda12x>=14' nvidia-cuda-nvrtc-cu12 (CUDA 12) or 'cupy-cuda13x>=14' "
    "'nvidia-cuda-nvrtc>=13,<14' (CUDA 13); from a checkout, pip install -e '.[cu12]' or '.[cu13]'"
)

try:
    import cupy  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != "cupy":
        raise
    # The command line (python -m cupy_merge, cupy-merge) answers --help, --version and --info
    # without CuPy and says what to install for the rest: only it may import the package then.
    if not (_sys.argv[:1] == ["-m"] or _os.path.basename(_sys.argv[0] if _sys.argv else "") == "cupy-merge"):
        raise ImportError(CUPY_HINT) from None
    HAS_CUPY = False
else:
    HAS_CUPY = True

if HAS_CUPY:
    # The framework integrations register their hooks with the dispatcher (importing no framework).
    from . import (
        distributed,
        jax,  # noqa: F401
        reference,
        torch_ops,  # noqa: F401 - registers the torch integration's hooks
        types,
    )
    from ._kernels import KernelCompileError
    from .backward import merge_state_backward, merge_states_backward, merge_states_varlen_backward
    from .bound import BoundMerge, bind
    from .invariance import batch_invariant, is_batch_invariant, set_batch_invariant
    from .merge import merge_attn_states, merge_state, merge_state_in_place
    from .merge_many import merge_states, merge_states_varlen

__all__ = [
    "BoundMerge",
    "KernelCompileError",
    "__version__",
    "batch_invariant",
    "bind",
    "distributed",
    "is_batch_invariant",
    "merge_attn_states",
    "merge_state",
    "merge_state_backward",
    "merge_state_in_place",
    "merge_states",
    "merge_states_backward",
    "merge_states_varlen",
    "merge_states_varlen_backward",
    "reference",
    "set_batch_invariant",
    "types",
]
