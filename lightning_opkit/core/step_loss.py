"""A LightningModule's training step run as a loss function: nothing logged, nothing stepped, nothing counted.

Every slow path that re-runs the user's step goes through :func:`training_loss`: NaNDetector's localization and
cause replays (and a spike's), PrecisionPolicy's measurement runs. Under automatic optimization the loss is what
``training_step`` returns. Under manual optimization (``automatic_optimization = False``) ``training_step`` trains
by itself, so inside :func:`training_loss` its ``manual_backward`` records the loss instead of running backward, and
``optimizer.step`` (a closure passed to it still runs: it computes the loss), ``zero_grad``, ``clip_gradients`` and
the LR schedulers' ``step`` do nothing: no weight, optimizer state, gradient, LR or ``global_step`` moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_opkit.core.patch import Patches
from lightning_opkit.core.replay import loss_of, quiet_logging

__all__ = ["held_training", "training_loss"]


def _held_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
    return closure() if closure is not None else None


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def held_training(pl_module: nn.Module) -> Iterator[list[Tensor]]:
    """Inside, a manually optimized LightningModule's step computes its loss but trains nothing.

    Yields the losses handed to ``manual_backward`` inside, in order (empty under automatic optimization, where
    nothing is held: ``training_step`` does not step there).

    Args:
        pl_module: the LightningModule (any other module: nothing is held).

    Example:
        >>> import torch
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> model = BoringModel()
        >>> model.automatic_optimization = False
        >>> with held_training(model) as losses:
        ...     model.manual_backward(torch.tensor(2.0, requires_grad=True))
        >>> losses
        [tensor(2., requires_grad=True)]
    """
    losses: list[Tensor] = []
    if getattr(pl_module, "automatic_optimization", True):
        yield losses
        return
    patches = Patches()
    patches.set(pl_module, "manual_backward", lambda loss, *args, **kwargs: losses.append(loss))
    patches.set(pl_module, "clip_gradients", _nothing)
    trainer = getattr(pl_module, "_trainer", None)
    if trainer is not None:
        # The wrappers ``self.optimizers()`` returns count ``global_step`` in their own ``step``; the raw optimizers
        # (``use_pl_optimizer=False``) are held too. ``zero_grad`` would erase the gradients of the step being
        # checked. A held step still runs a closure passed to it: that is where such a step computes its loss.
        for optimizer in [*trainer.strategy._lightning_optimizers, *trainer.optimizers]:
            patches.set(optimizer, "step", _held_step)
            patches.set(optimizer, "zero_grad", _nothing)
        for config in trainer.lr_scheduler_configs:
            patches.set(config.scheduler, "step", _nothing)
    try:
        yield losses
    finally:
        patches.restore()


def training_loss(pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                  training_step: Callable[..., Any] | None = None) -> Tensor | None:
    """The loss of ``pl_module``'s training step on ``batch``, computed without training on it.

    Under manual optimization, the sum of the losses the step handed to ``manual_backward`` (its gradients are what
    those backward calls would have accumulated), else what it returned.

    Args:
        pl_module: the LightningModule.
        batch: the batch.
        batch_idx: its index.
        training_step: the step to run (default ``pl_module.training_step``): the user's own, where a callback has
            wrapped it.

    Returns:
        The loss, or ``None`` when the step gave none.

    Example:
        >>> import torch
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> model = BoringModel()
        >>> training_loss(model, torch.ones(2, 32), 0).shape
        torch.Size([])
    """
    step = training_step if training_step is not None else pl_module.training_step
    with quiet_logging(pl_module), held_training(pl_module) as backwards:
        output = step(batch, batch_idx)
    if backwards:
        total = backwards[0]
        for loss in backwards[1:]:
            total = total + loss
        return total
    return loss_of(output)
