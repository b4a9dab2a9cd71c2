"""Every option of the merges, normalised once from the public keyword arguments of the same names.

The builders (``two_state_options``, ``many_state_options``, ``backward_options``) are what the
declarations (``_ops``) name: each turns the caller's keywords into a hashable options record
(``_operands``), raising ``TypeError`` or ``ValueError`` naming the argument for a bad one. They
read no array (``output_block_scale`` only says whether group scales are asked for), so they run
before any operand is looked at; the array rules are ``_checks``'.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from ._catalogue import MAX_QUANT_GROUP, NVFP4, OUTPUT_CTYPES, VALUE_CTYPES
from ._operands import BackwardOptions, ManyStateOptions, TwoStateOptions

_LSE_BASES = {"e": 0, 2: 1, "2": 1}


def lse_base_flag(lse_base: Any) -> int:
    """``"e"`` (natural log, vLLM) -> 0; ``2`` (FlashInfer) -> 1; anything else raises."""
    if type(lse_base) is not bool:
        try:
            flag = _LSE_BASES.get(lse_base)
        except TypeError:  # unhashable, e.g. an array
            flag = None
        if flag is not None:
            return flag
        if isinstance(lse_base, float) and lse_base == math.e:
            return 0
    raise ValueError(f'lse_base: expected "e" (natural log, as vLLM) or 2 (as FlashInfer), got {lse_base!r}')


def value_dtype_name(dtype: Any, name: str = "out_dtype", allowed: dict = VALUE_CTYPES) -> str:
    """The name of a dtype given as a string, NumPy/CuPy/ml_dtypes dtype or torch dtype."""
    text = str(dtype).removeprefix("torch.")
    if text not in allowed:
        try:
            import numpy

            text = numpy.dtype(dtype).name
        except (TypeError, ValueError, SyntaxError):  # NumPy parses strings as dtype specs: ",", "f4,(1"...
            pass
    if text not in allowed:
        raise TypeError(f"{name}: expected {_dtype_list(allowed)}, got {dtype!r}")
    return text


def _dtype_list(allowed: dict) -> str:
    names = list(allowed)
    return ", ".join(names[:-1]) + " or " + names[-1]


def optional_value_dtype(dtype: Any) -> str | None:
    """An output dtype: a value dtype, FP8 (``"float8_e4m3fn"``) or NVFP4 (``"nvfp4"``, torch's
    ``float4_e2m1fn_x2``), or None."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype == "nvfp4":
        return NVFP4
    return value_dtype_name(dtype, allowed=OUTPUT_CTYPES)


def swizzled_scales(is_sf_swizzled_layout: Any, block_scale: Any) -> bool:
    """Whether NVFP4 block scales are in the GEMMs' 128 x 4 swizzled layout (the default) or
    row-major ``[num_tokens, num_heads * head_size // 16]`` (False: it needs block scales)."""
    swizzled = flag(is_sf_swizzled_layout, "is_sf_swizzled_layout")
    if not swizzled and block_scale is None:
        raise ValueError("is_sf_swizzled_layout: False is the layout of NVFP4 block scales; no output_block_scale given")
    return swizzled


def quant_group(group_size: Any, block_scale: Any, scale_ue8m0: Any) -> tuple[int | None, int]:
    """``(group_size, ue8m0 flag)`` of an output with block scales (FP8 or NVFP4), ``(None, 0)``
    without."""
    ue8m0 = flag(scale_ue8m0, "scale_ue8m0")
    if block_scale is None:
        if group_size is not None:
            raise ValueError("quant_group_size: given without output_block_scale, where the group scales go")
        if ue8m0:
            raise ValueError("scale_ue8m0: given without output_block_scale (it rounds the group scales)")
        return None, 0
    if group_size is None:  # FP8 needs it, NVFP4 has 16 (the checks know which the output is)
        return None, int(ue8m0)
    if isinstance(group_size, bool) or not (isinstance(group_size, int) or type(group_size).__module__ == "numpy"):
        raise TypeError(f"quant_group_size: expected an int, got {type(group_size).__name__}")
    try:
        group_size = operator.index(group_size)  # a NumPy integer as a Python int, as the token counts take it
    except TypeError:
        raise TypeError(f"quant_group_size: expected an int, got {type(group_size).__name__}") from None
    if not 1 <= group_size <= MAX_QUANT_GROUP:
        raise ValueError(f"quant_group_size: expected 1 to {MAX_QUANT_GROUP}, got {group_size}")
    return group_size, int(ue8m0)


def token_count(value: Any, name: str = "prefill_tokens_with_context") -> int | None:
    """``None`` or a non-negative Python or NumPy integer (a 0-d NumPy array too), as a Python int.

    Device arrays and tensors are refused: their value would be read on the host (a
    synchronisation) and could change after the call was planned.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or type(value).__module__ == "numpy"):
        if type(value).__name__ == "SymInt" and type(value).__module__.startswith("torch"):
            # A size traced outside Dynamo (make_fx, non-strict export): kept symbolic, as the op's
            # schema declares it; the fake checks its traced value and the kernel's call its value.
            return value
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}")
    try:
        # A Python int as it is: under torch.compile it stays a symbolic size (operator.index would
        # make it a constant, and every new value a recompile).
        count = value if isinstance(value, int) else operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected None or an int, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name}: expected >= 0, got {count}")
    return count


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


_DEFAULT_TWO_STATE_OPTIONS = TwoStateOptions()
_DEFAULT_MANY_STATE_OPTIONS = {flag: ManyStateOptions(check_indptr=flag) for flag in (False, True)}


def two_state_options(
    *,
    lse_base: Any = "e",
    prefill_tokens_with_context: Any = None,
    out_dtype: Any = None,
    output_block_scale: Any = None,
    quant_group_size: Any = None,
    scale_ue8m0: Any = False,
    quant_scale_ue8m0: Any = False,
    is_sf_swizzled_layout: Any = True,
) -> TwoStateOptions:
    """A two-way merge's options from the public arguments of the same names
    (``quant_scale_ue8m0`` is vLLM's name for ``scale_ue8m0``)."""
    if (
        type(lse_base) is str
        and lse_base == "e"
        and prefill_tokens_with_context is None
        and out_dtype is None
        and output_block_scale is None
        and quant_group_size is None
        and scale_ue8m0 is False
        and quant_scale_ue8m0 is False
        and is_sf_swizzled_layout is True
    ):
        return _DEFAULT_TWO_STATE_OPTIONS  # the common call, without the checks' calls
    ue8m0_flag = flag(scale_ue8m0, "scale_ue8m0") or flag(quant_scale_ue8m0, "quant_scale_ue8m0")
    group_size, ue8m0 = quant_group(quant_group_size, output_block_scale, ue8m0_flag)
    return TwoStateOptions(
        lse_base_2=lse_base_flag(lse_base),
        merge_tokens=token_count(prefill_tokens_with_context),
        out_dtype=optional_value_dtype(out_dtype),
        group_size=group_size,
        scale_ue8m0=ue8m0,
        swizzled_scales=swizzled_scales(is_sf_swizzled_layout, output_block_scale),
    )


def many_state_options(
    *,
    lse_base: Any = "e",
    out_dtype: Any = None,
    check_indptr: Any = False,
    output_block_scale: Any = None,
    quant_group_size: Any = None,
    scale_ue8m0: Any = False,
    is_sf_swizzled_layout: Any = True,
) -> ManyStateOptions:
    """An N-way merge's options from the public arguments of the same names."""
    if (
        type(lse_base) is str
        and lse_base == "e"
        and out_dtype is None
        and output_block_scale is None
        and quant_group_size is None
        and scale_ue8m0 is False
        and type(check_indptr) is bool
        and is_sf_swizzled_layout is True
    ):
        return _DEFAULT_MANY_STATE_OPTIONS[check_indptr]
    group_size, ue8m0 = quant_group(quant_group_size, output_block_scale, scale_ue8m0)
    return ManyStateOptions(
        lse_base_2=lse_base_flag(lse_base),
        out_dtype=optional_value_dtype(out_dtype),
        check_indptr=flag(check_indptr, "check_indptr"),
        group_size=group_size,
        scale_ue8m0=ue8m0,
        swizzled_scales=swizzled_scales(is_sf_swizzled_layout, output_block_scale),
    )


def backward_options(*, lse_base: Any = "e") -> BackwardOptions:
    """A merge gradient's options from the public arguments of the same names."""
    return BackwardOptions(lse_base_2=lse_base_flag(lse_base))
