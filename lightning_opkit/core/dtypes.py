"""Dtypes as opkit names and casts them (``fp32``, ``bf16``, the profiler's C++ names), and a module held in fp32."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.patch import Patches
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.torch_compat import tree_map
from lightning_opkit.opclass import NEVER_CAST, function_info

__all__ = ["BY_NAME", "PROFILER_DTYPES", "autocast_off", "cast", "full_name", "has_low_weights", "hold_fp32", "in_fp32",
           "short_name"]

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


# One module run in fp32 while everything around it runs as written: for a replay, or from now on (a repair).
#
# Autocast is off inside the module and its 16-bit inputs become fp32. Where its own weights are 16-bit
# (``precision="16-true"``), every op inside it also casts all its floating arguments, the weights among them (through
# a differentiable cast: their gradients reach the 16-bit parameters), to fp32. Its outputs are cast back to its
# inputs' 16-bit dtype where the modules after it need that (their 16-bit weights refuse an fp32 input), else they go
# on in fp32 (under autocast, an fp32 activation is what the next ops expect, and it keeps a value 16 bits cannot
# hold). A precision policy, when one is attached, does this through its own mode (``running_in``, ``pin``).


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Inside, autocast is off on every device where it was on; on exit it is on again there.

    Example:
        >>> with torch.autocast("cpu"), autocast_off():
        ...     torch.is_autocast_enabled("cpu")
        False
    """
    devices = _pause_autocast()
    try:
        yield
    finally:
        for d in devices:
            torch.set_autocast_enabled(d, True)


class _Fp32Args(TorchFunctionMode):
    """While on the mode stack (inside the module only), every op's floating arguments are cast to fp32."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if SUSPENDED.depth:
            return func(*args, **kwargs)
        cls, inplace = function_info(func)
        # In-place ops write into their first argument: a cast copy would take the write instead.
        if cls in NEVER_CAST or inplace or "out" in kwargs:
            return func(*args, **kwargs)
        return func(*(cast(a, torch.float32) for a in args), **{k: cast(v, torch.float32) for k, v in kwargs.items()})


def has_low_weights(module: nn.Module) -> bool:
    """Whether any floating parameter of ``module`` is 16-bit (``precision="16-true"`` or ``"bf16-true"``).

    Example:
        >>> has_low_weights(nn.Linear(2, 2)), has_low_weights(nn.Linear(2, 2).half())
        (False, True)
    """
    return any(p.is_floating_point() and p.element_size() < 4 for p in module.parameters())


def _low(values: Any) -> torch.dtype | None:
    return next((v.dtype for v in values if isinstance(v, Tensor) and v.is_floating_point() and v.element_size() < 4),
                None)


def _pause_autocast() -> list[str]:
    """Turn autocast off where it is on; the devices to turn it on again."""
    devices = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
    for d in devices:
        torch.set_autocast_enabled(d, False)
    return devices


def _up(value: Any) -> Any:
    return value.float() if isinstance(value, Tensor) and value.is_floating_point() and value.element_size() < 4 \
        else value


def hold_fp32(patches: Patches, module: nn.Module, *, weights: bool, cast_back: bool) -> None:
    """From now on (while ``patches`` hold), ``module`` runs in fp32.

    Args:
        patches: where its two hooks are kept (restored by the owner).
        module: the module.
        weights: cast its ops' floating arguments, its own weights included, to fp32 too (16-bit weights).
        cast_back: hand its floating outputs on in its inputs' 16-bit dtype (where no input is 16-bit, as an
            embedding's indices, in its own weights' 16-bit dtype).

    Example:
        >>> layer, patches = nn.Linear(2, 2).half(), Patches()
        >>> hold_fp32(patches, layer, weights=True, cast_back=False)
        >>> layer(torch.ones(1, 2, dtype=torch.half)).dtype
        torch.float32
        >>> patches.restore()
    """
    mode = _Fp32Args()
    saved: list[tuple[list[str], torch.dtype | None]] = []
    own = _low(list(module.parameters()))

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        saved.append((_pause_autocast(), _low([*args, *kwargs.values()]) or own))
        if weights:
            mode.__enter__()
        return tuple(_up(a) for a in args), {k: _up(v) for k, v in kwargs.items()}

    def leave(mod: nn.Module, args: Any, output: Any) -> Any:
        if not saved:
            return None
        devices, low = saved.pop()
        if weights:
            mode.__exit__(None, None, None)
        for d in devices:
            torch.set_autocast_enabled(d, True)
        if not cast_back or low is None:
            return None
        return tree_map(lambda t: t.to(low) if isinstance(t, Tensor) and t.is_floating_point() else t, output)

    patches.hold(module.register_forward_pre_hook(enter, prepend=True, with_kwargs=True))
    patches.hold(module.register_forward_hook(leave, always_call=True))


@contextlib.contextmanager
def in_fp32(module: nn.Module, *, weights: bool, cast_back: bool = True) -> Iterator[None]:
    """Inside, ``module`` runs in fp32 (:func:`hold_fp32`); a replay's question "is it finite in fp32?".

    A forward hook the caller registered before this sees the fp32 outputs (the cast back is the hook after it).

    Args:
        module: the module.
        weights: its own 16-bit weights in fp32 too.
        cast_back: hand its outputs on in its inputs' 16-bit dtype.

    Example:
        >>> layer = nn.Linear(2, 2).half()
        >>> with in_fp32(layer, weights=True, cast_back=False):
        ...     layer(torch.ones(1, 2, dtype=torch.half)).dtype
        torch.float32
    """
    patches = Patches()
    hold_fp32(patches, module, weights=weights, cast_back=cast_back)
    try:
        yield
    finally:
        patches.restore()
