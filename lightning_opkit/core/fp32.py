"""Run one module in fp32, its own 16-bit weights included, while everything around it runs as written.

A NaN cause replay asks "is this module finite in fp32?". Under ``precision="16-true"`` the module's weights are 16-bit,
so casting its inputs is not enough: every op inside it casts all its floating arguments (the weights among them,
through a differentiable cast) to fp32. A precision policy, when one is attached, does this through its own mode
(``running_in``); this is the same for a run without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.dtypes import cast
from lightning_opkit.core.replay import autocast_off
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.opclass import NEVER_CAST, function_info

__all__ = ["fp32_inside"]


class _Fp32Inside(TorchFunctionMode):
    """Casts the floating arguments of every op run while ``depth`` > 0 to fp32, with autocast off."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.depth or SUSPENDED.depth:
            return func(*args, **kwargs)
        cls, inplace = function_info(func)
        # In-place ops write into their first argument: a cast copy would take the write instead.
        if cls in NEVER_CAST or inplace or "out" in kwargs:
            return func(*args, **kwargs)
        args = tuple(cast(a, torch.float32) for a in args)
        kwargs = {k: cast(v, torch.float32) for k, v in kwargs.items()}
        with autocast_off():
            return func(*args, **kwargs)


@contextlib.contextmanager
def fp32_inside(module: nn.Module) -> Iterator[None]:
    """Inside, every op that ``module`` runs casts its floating arguments, its own weights included, to fp32.

    Its outputs come out in fp32; pair it with :func:`~lightning_opkit.core.replay.autocast_off_in` to hand them on
    in the dtype the modules after it expect. Running statistics it updates (BatchNorm under 16-true) are updated in
    a copy: meant for replays, whose buffers are put back anyway.

    Args:
        module: the module to run in fp32.

    Example:
        >>> layer = nn.Linear(2, 2).half()
        >>> with fp32_inside(layer):
        ...     layer(torch.ones(1, 2, dtype=torch.half)).dtype
        torch.float32
    """
    mode = _Fp32Inside()

    def enter(m: nn.Module, args: Any) -> None:
        mode.depth += 1

    def leave(m: nn.Module, args: Any, output: Any) -> None:
        mode.depth -= 1

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]
    try:
        with mode:
            yield
    finally:
        for handle in handles:
            handle.remove()
