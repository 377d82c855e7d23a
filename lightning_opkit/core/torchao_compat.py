"""torchao's private fields that opkit reads or writes, each behind one name here.

FSDP2's float8 all-gather wraps a weight's local shard in torchao's ``WeightWithDynamicFloat8CastTensor``: opkit
reads the plain shard inside it (a check or a census reads values, not the cast), the float8 dtype it casts to, and
sets the scale one all-reduce computed for a step. None of these has a public name; a torchao release that moves one
is mended in this file (``tests/core/test_torchao_compat.py`` finds each on the installed torchao).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["float8_dtype", "set_scale", "wrapped_in"]


def wrapped_in(tensor: Any) -> torch.Tensor | None:
    """The plain tensor inside torchao's float8 all-gather wrapper; ``None`` where ``tensor`` is no such wrapper.

    Example:
        >>> wrapped_in(torch.ones(2)) is None
        True
    """
    if isinstance(tensor, torch.Tensor) and hasattr(tensor, "fsdp_pre_all_gather") and hasattr(tensor, "_tensor"):
        return tensor._tensor
    return None


def float8_dtype(wrapper: Any) -> torch.dtype:
    """The float8 dtype torchao's wrapper casts its tensor to before a gather."""
    return wrapper._dtype


def set_scale(wrapper: Any, scale: torch.Tensor | None) -> None:
    """The scale the wrapper's next cast uses instead of computing its own amax (``None``: its own again)."""
    wrapper._precomputed_scale = scale
