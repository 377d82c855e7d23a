"""Repair on precision faults: the culprit of a fault whose cause is precision is pinned to fp32 from the next step.

The cause replay has already shown that the step is finite with that module in fp32 and non-finite as is, so the
fix is known; NaNDetector applies it (``repair=True``) instead of leaving the user to stop, edit and restart:

- a precision policy attached: one more module override, through the policy (its mode runs the module's ops in fp32);
- autocast (``16-mixed``, ``bf16-mixed``) without a policy: autocast off inside the module, its inputs in fp32, its
  outputs on in fp32 (the next ops take them, and they keep values 16 bits cannot hold);
- 16-bit weights (``16-true``, ``bf16-true``): its ops compute in fp32 on fp32 copies of its weights, its outputs cast
  back to the dtype the next modules' weights take.

A pin is kept across a resume (the callback's state), taken on every rank alike (every rank builds the same report),
and undone at teardown. A module that faults again while pinned is not pinned again.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_opkit.core.dtypes import has_low_weights, hold_fp32
from lightning_opkit.core.patch import Patches

__all__ = ["Repairs"]


class Repairs:
    """The modules pinned to fp32 in this run (module path -> dtype), applied to a model and undone on release.

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(2, 2)).half()
        >>> repairs = Repairs()
        >>> repairs.pin(model, "0", pinner=None)
        '0 -> fp32'
        >>> model(torch.ones(1, 2, dtype=torch.half)).dtype  # fp32 inside, handed on in the weights' dtype
        torch.float16
        >>> repairs.release(); repairs.pinned
        {'0': 'fp32'}
    """

    def __init__(self) -> None:
        #: module path -> the dtype it was pinned to (kept in the callback's state)
        self.pinned: dict[str, str] = {}
        self._patches = Patches()
        self._applied: set[str] = set()

    def pin(self, model: nn.Module, path: str, pinner: Any | None) -> str:
        """Pin the module at ``path`` to fp32 from the next forward on; returns ``"<path> -> fp32"``.

        Args:
            model: the root module.
            path: the culprit's path in ``model.named_modules()``.
            pinner: an attached precision policy (``pin(name, module, dtype)``), else ``None``.
        """
        self.pinned[path] = "fp32"
        self._apply(model, path, pinner)
        return f"{path} -> fp32"

    def apply_all(self, model: nn.Module, pinner: Any | None) -> None:
        """Apply every pin not applied yet (after a resume, or on a new fit of the same model)."""
        for path in self.pinned:
            if path not in self._applied and path in dict(model.named_modules()):
                self._apply(model, path, pinner)

    def _apply(self, model: nn.Module, path: str, pinner: Any | None) -> None:
        module = model.get_submodule(path)
        if pinner is not None:
            pinner.pin(path, module, "fp32")
        else:
            # a weightless culprit (an activation, a softmax) in a 16-bit model hands on in 16 bits too: the next
            # module's weights are 16-bit, and would refuse fp32 inputs
            low = has_low_weights(module)
            hold_fp32(self._patches, module, weights=low, cast_back=low or has_low_weights(model))
        self._applied.add(path)

    def release(self) -> None:
        """Undo the hooks this object holds (a policy's pins are the policy's, undone at its teardown)."""
        self._patches.restore()
        self._applied.clear()
