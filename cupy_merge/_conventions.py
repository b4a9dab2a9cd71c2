"""The caller-facing conventions every merge accepts: LSE base and output dtype."""

from __future__ import annotations

import math
from typing import Any

from ._checks import VALUE_CTYPES


def lse_base_flag(lse_base: Any) -> int:
    """``"e"`` (natural log, vLLM) -> 0; ``2`` (FlashInfer) -> 1; anything else raises."""
    if lse_base in ("e", math.e) and not isinstance(lse_base, bool):
        return 0
    if lse_base in (2, "2") and not isinstance(lse_base, bool):
        return 1
    raise ValueError(f'lse_base: expected "e" (natural log, as vLLM) or 2 (as FlashInfer), got {lse_base!r}')


def value_dtype_name(dtype: Any, name: str = "out_dtype") -> str:
    """The name of a value dtype given as a string, NumPy/CuPy dtype or torch dtype."""
    text = str(dtype).removeprefix("torch.")
    if text not in VALUE_CTYPES:
        try:
            import numpy

            text = numpy.dtype(dtype).name
        except TypeError:
            pass
    if text not in VALUE_CTYPES:
        raise TypeError(f"{name}: expected float32, float16 or bfloat16, got {dtype!r}")
    return text
