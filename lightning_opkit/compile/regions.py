"""Compiled regions: which blocks to compile (``modules="auto"``), what each region cost and gained, old checkpoints.

Plain functions and a small record per region, tested without a Trainer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

__all__ = ["Region", "find_blocks", "strip_compile_prefix"]

_ORIG_MOD = re.compile(r"(^|\.)_orig_mod\.")


def find_blocks(model: nn.Module) -> list[str]:
    """Paths of the repeated blocks of ``model``, the outermost such sets.

    Blocks are the children of a ``ModuleList`` / ``Sequential`` whose children all share one class that has
    submodules of its own (a block, not a leaf layer).

    Args:
        model: the model to search (the LightningModule, so paths match ``named_modules()`` there).

    Example:
        >>> from torch import nn
        >>> block = lambda: nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([block(), block()]))
        >>> find_blocks(net)
        ['1.0', '1.1']
    """
    found: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if any(name == f or name.startswith(f + ".") for f in found):
            continue  # inside a block already chosen: the outermost set wins
        kinds = {type(child) for child in module}
        if len(kinds) == 1 and next(module[0].children(), None) is not None:
            found.extend(f"{name}.{i}" if name else str(i) for i in range(len(module)))
    return found


def strip_compile_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A ``state_dict`` without the ``_orig_mod.`` segments that ``torch.compile``'s wrapper puts in its keys.

    A checkpoint written while a module was wrapped by ``torch.compile(module)`` (``model.encoder._orig_mod.weight``)
    then loads into the plain model. :class:`~lightning_opkit.TorchCompile` applies it to checkpoints it loads.

    Args:
        state_dict: the keys and tensors, as saved.

    Example:
        >>> list(strip_compile_prefix({"_orig_mod.fc.weight": 1, "encoder._orig_mod.w": 2}))
        ['fc.weight', 'encoder.w']
    """
    return {_ORIG_MOD.sub(r"\1", key): value for key, value in state_dict.items()}

def loading_old_checkpoints(user_hook: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
    """Wrap a LightningModule's ``on_load_checkpoint`` so checkpoints with ``_orig_mod.`` keys load into it.

    It runs before Lightning loads the weights (a callback's own hook would run after): a checkpoint written by
    torch.compile's wrapper has ``_orig_mod.`` in its keys, which the plain model does not.

    Args:
        user_hook: the module's own ``on_load_checkpoint``.

    Example:
        >>> hook = loading_old_checkpoints(lambda checkpoint: None)
        >>> checkpoint = {"state_dict": {"_orig_mod.w": 1}}
        >>> hook(checkpoint), checkpoint
        (None, {'state_dict': {'w': 1}})
    """

    def on_load_checkpoint(checkpoint: dict[str, Any]) -> Any:
        state = checkpoint.get("state_dict")
        if isinstance(state, dict) and any("_orig_mod." in key for key in state):
            checkpoint["state_dict"] = strip_compile_prefix(state)
            rank_zero_info("TorchCompile: loading a checkpoint with `_orig_mod.` keys into the plain model.")
        return user_hook(checkpoint)

    return on_load_checkpoint



@dataclass
class Region:
    """What one compiled region cost and gained in this run (compile figures are dynamo's, during its calls)."""

    name: str
    code: Any = None  # the code object dynamo caches on (shared by identical blocks)
    calls: int = 0
    compiles: int = 0
    compile_time_s: float = 0.0
    graphs: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    speedup: float | None = None  # eager time / compiled time, with measure_speedup
    eager: bool = False  # switched to eager on its recompile limit

    def row(self) -> list[Any]:
        """The region's row in the per-region table."""
        speed = "-" if self.speedup is None else f"{self.speedup:.2f}x"
        return [self.name or "<LightningModule>", self.calls, self.compiles, f"{self.compile_time_s:.2f}",
                self.graphs, self.graph_breaks, self.recompiles, speed, "eager" if self.eager else "compiled"]


REGION_HEADERS = ["region", "calls", "compiles", "compile s", "graphs", "graph breaks", "recompiles",
                  "speedup (eager/compiled)", "runs"]


def cache_entries(code: Any) -> int:
    """Dynamo cache entries of a code object: what ``recompile_limit`` counts."""
    if code is None:
        return 0
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def compiled_code(compiled: Any) -> Any:
    """The code object dynamo caches a ``torch.compile``d callable on."""
    fn = getattr(compiled, "_torchdynamo_orig_callable", None)
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


def recompile_limit() -> int:
    """Dynamo's per-code-object limit of cache entries (``recompile_limit``, formerly ``cache_size_limit``)."""
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", getattr(config, "cache_size_limit", 8)))
