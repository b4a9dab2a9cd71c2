"""Building device arrays of every value dtype, and reading them back as float64."""

from __future__ import annotations

import numpy as np


def bfloat16_dtype():
    import ml_dtypes

    return ml_dtypes.bfloat16


def cupy_supports(dtype: str) -> bool:
    import cupy

    try:
        cupy.zeros(1, dtype=bfloat16_dtype() if dtype == "bfloat16" else dtype)
        return True
    except (ImportError, TypeError, ValueError, NotImplementedError):
        return False


def to_device(host: np.ndarray, dtype: str, backend: str = "cupy"):
    """``host`` (float32/float64) rounded to ``dtype`` on the GPU, as CuPy or torch."""
    if backend == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(host, dtype=np.float32)).to(
            device="cuda", dtype=getattr(torch, dtype)
        )
    import cupy

    target = bfloat16_dtype() if dtype == "bfloat16" else np.dtype(dtype)
    return cupy.asarray(np.asarray(host, dtype=np.float32)).astype(target)


def to_host(array) -> np.ndarray:
    """Any CuPy array or torch tensor as a float64 NumPy array."""
    if hasattr(array, "detach"):
        return array.detach().float().cpu().numpy().astype(np.float64)
    import cupy

    return cupy.asnumpy(array.astype(np.float32)).astype(np.float64)


def fill_nan(array) -> None:
    """Poison an output so that any element the kernel fails to write shows as NaN."""
    if hasattr(array, "detach"):
        array.fill_(float("nan"))
    else:
        array.fill(np.nan)


def backend_for(dtype: str) -> str:
    """CuPy where it can hold ``dtype``; torch otherwise (bfloat16 on CuPy without ml_dtypes)."""
    return "cupy" if cupy_supports(dtype) else "torch"


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))
