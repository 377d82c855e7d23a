"""Old checkpoints: those written by ``torch.compile``'s wrapper (``_orig_mod.`` keys) load into the plain model.

:class:`~lightning_opkit.TorchCompile` compiles in place, so its own checkpoints have the plain model's keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["loading_old_checkpoints", "strip_compile_prefix"]

_ORIG_MOD = re.compile(r"(^|\.)_orig_mod\.")


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
