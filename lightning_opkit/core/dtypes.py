"""Dtype names as opkit prints them: ``fp32``, ``bf16``, ...; and the profiler's C++ type names mapped to them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["BY_NAME", "PROFILER_DTYPES", "cast", "full_name", "short_name"]

#: short name -> dtype, for the dtypes opkit measures and casts to
BY_NAME: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                   "fp64": torch.float64}
_SHORT = {dtype: name for name, dtype in BY_NAME.items()}
_SHORT.update({getattr(torch, n): "fp8" for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                   "float8_e5m2fnuz") if hasattr(torch, n)})

#: the profiler's recorded input dtypes (C++ type names) -> short name
PROFILER_DTYPES: dict[str, str] = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64",
                                   "c10::Float8_e4m3fn": "fp8", "c10::Float8_e5m2": "fp8",
                                   "c10::Float8_e4m3fnuz": "fp8", "c10::Float8_e5m2fnuz": "fp8"}


def short_name(dtype: torch.dtype) -> str:
    """``"bf16"`` for ``torch.bfloat16``, ``"fp8"`` for every float8, else torch's own name.

    Example:
        >>> short_name(torch.bfloat16), short_name(torch.int64)
        ('bf16', 'int64')
    """
    return _SHORT.get(dtype) or full_name(dtype)


def full_name(dtype: torch.dtype) -> str:
    """Torch's name without the module: ``"bfloat16"`` (what NaN reports show).

    Example:
        >>> full_name(torch.float16)
        'float16'
    """
    return str(dtype).removeprefix("torch.")


def cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors (alone or in a list/tuple of tensors) in ``dtype``; anything else as is.

    Example:
        >>> cast([torch.ones(1), torch.ones(1, dtype=torch.int64)], torch.bfloat16)
        [tensor([1.], dtype=torch.bfloat16), tensor([1])]
    """
    if isinstance(value, Tensor):
        # ``to(dtype=...)`` parses fastest of the ``to`` forms: the precision policy runs this for every argument of
        # every governed op
        return value.to(dtype=dtype) if value.dtype != dtype and value.is_floating_point() else value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
        return type(value)(cast(v, dtype) for v in value)
    return value
