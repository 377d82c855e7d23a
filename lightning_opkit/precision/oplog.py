"""The ops a step runs, recorded once per (op, input shapes) with how often each ran: what op timing replays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.ranks import local
from lightning_opkit.core.torch_compat import tree_leaves, tree_map
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.census import UPDATED_ARGS
from lightning_opkit.precision.dtypes import NEVER_CAST
from lightning_opkit.precision.function_mode import policy_info

__all__ = ["OpLog", "Stat"]


class OpLog(TorchFunctionMode):
    """Records one example call per (op, input shapes) of each governed class, and how often it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.examples: dict[tuple[Any, ...], tuple[str, Callable[..., Any], tuple, dict]] = {}
        self.counts: dict[tuple[Any, ...], int] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        cls, inplace = policy_info(func)
        # a backward or a higher-order operator inside the step (its class is no op class) has nothing to time
        if cls in OP_CLASSES and cls not in NEVER_CAST and not inplace and "out" not in kwargs:
            sig = tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else None
                        for t in tree_leaves((args, kwargs)))
            key = (func, sig)
            if key not in self.examples:
                # A DTensor (tensor parallel) by its local shard: timing it alone must run no collective, since
                # each rank repeats an op as often as its own clock asks.
                keep = tree_map(lambda t: local(t).detach() if isinstance(t, Tensor) else t, (args, kwargs))
                if func in UPDATED_ARGS:
                    # Timing must not write into the model's running statistics, nor differentiate them.
                    positions, names = UPDATED_ARGS[func]
                    keep = (tuple(stat(a) if i in positions else a for i, a in enumerate(keep[0])),
                            {k: stat(v) if k in names else v for k, v in keep[1].items()})
                self.examples[key] = (cls, func, *keep)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **kwargs)


class Stat(Tensor):
    """A running statistic: cloned for timing, never a differentiable leaf."""


def stat(value: Any) -> Any:
    return value.clone().as_subclass(Stat) if isinstance(value, Tensor) else value
