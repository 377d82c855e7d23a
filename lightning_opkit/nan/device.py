"""NaNDetector's ``decide="device"``: a bad step's update is left out on the device, and the host reads why a step late.

With ``decide="host"`` a checked step reads its flags on the host between backward and ``optimizer.step``: on a GPU
the host waits there for backward to finish before it launches the optimizer, and the GPU idles while it does. With
``decide="device"`` nothing is read then:

- the flags stay on the device and go, as one 0-d tensor, to the optimizer's ``found_inf``: a fused optimizer (the
  ``fused=True`` Adam, AdamW, SGD, Adagrad) leaves its update out on the device, as it does for a GradScaler, and puts
  its step count back; the buffers the forward wrote (BatchNorm statistics) are put back on the device too;
- the flags are copied to the host without blocking (pinned memory, an event), and read at the next step, after that
  step's backward was launched, when the copy has long finished: no wait that idles the device.

What a skipped step then guarantees: weights, optimizer state and buffers bit-identical to a run without the batch.
Unlike ``decide="host"``, a step-interval LR schedule and ``trainer.global_step`` have advanced; the report, the
replays and the action come one step late (``raise`` and ``stop`` leave that next step out as well, so the model is
the one from before the bad batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_opkit.core.torch_compat import takes_found_inf
from lightning_opkit.nan.check import read

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_opkit.nan.actions import Actions, StepSkipper
    from lightning_opkit.nan.replays import MicroBatch, Replays

__all__ = ["DeviceDecision", "HostCopy", "Read", "as_of_step", "check_device_decision"]


@contextlib.contextmanager
def as_of_step(trainer: pl.Trainer, step: int) -> Iterator[None]:
    """``trainer.global_step`` reads ``step`` inside: a replay a step late runs as of the step it replays.

    A model that reads its step (a warm-up, a schedule, a fault that fires at one step) replays as it ran; the report
    and its TensorBoard entries carry that step. Automatic optimization only (NaNDetector's hooks need it).

    Args:
        trainer: the Trainer.
        step: the global step to read inside.
    """
    total = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    completed, total.completed = total.completed, step
    try:
        yield
    finally:
        total.completed = completed


class HostCopy:
    """A device tensor copied to the host without blocking, to be read later.

    On CUDA the copy goes to pinned memory behind an event, and :meth:`read` asks the event first; it waits, if the copy
    has not finished, for that event alone, not for the stream: work queued after the copy keeps the device busy. On
    CPU the copy is the read.

    Args:
        values: the tensor (on any device).

    Example:
        >>> HostCopy(torch.tensor([1.0, 0.0])).read()
        [1.0, 0.0]
    """

    def __init__(self, values: Tensor) -> None:
        self._event: Any = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = values.detach().clone()

    def read(self) -> list[Any]:
        """The values, on the host: at most a wait for the copy itself (none once it finished, the usual case)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._host.tolist()


def check_device_decision(trainer: pl.Trainer) -> None:
    """``decide="device"`` needs optimizers that take ``found_inf``, and no GradScaler of its own deciding skips."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError("NaNDetector(decide='device') cannot share the optimizer's found_inf with this run's"
                         f" GradScaler (precision={trainer.precision!r}): use decide='host', or bf16")
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError("NaNDetector(decide='device') needs automatic optimization (it hands the optimizer step its"
                         " found_inf): this LightningModule optimizes manually; use decide='host'")
    for optimizer in trainer.optimizers:
        if not takes_found_inf(optimizer):
            raise ValueError(f"NaNDetector(decide='device') needs an optimizer that leaves an update out on the device"
                             f" (found_inf): {type(optimizer).__name__} here is not fused. Pass fused=True (torch's"
                             " Adam, AdamW, SGD, Adagrad), or use decide='host'")


@dataclass
class _Late:
    """A checked step whose flags were left on the device, to be read at the next step."""

    pending: list[MicroBatch]
    found: HostCopy
    step: int
    epoch: int


@dataclass
class Read:
    """A checked step's flags as read a step late: what it found, and the step it is about.

    Args:
        late: the step.
        loss_bad: its loss was non-finite (on some rank).
        grad_bad: a gradient was non-finite (on some rank).
        dead: the dead-parameter flag was set.
    """

    late: _Late
    loss_bad: bool
    grad_bad: bool
    dead: bool


class DeviceDecision:
    """``decide="device"``: a checked step's flags left on the device now, read and acted on a step later.

    Example:
        >>> decision = DeviceDecision()
        >>> decision.late is None
        True
    """

    def __init__(self) -> None:
        #: the checked step not read yet
        self.late: _Late | None = None

    def leave(self, found: Tensor, skipper: StepSkipper, pending: list[MicroBatch], step: int, epoch: int) -> None:
        """Hand this step's flags to the optimizer's ``found_inf`` and the buffers' restore, and copy them to the host.

        Args:
            found: the check's flags (:func:`~lightning_opkit.nan.check.flags`), on the device.
            skipper: the detector's step skipper.
            pending: the step's micro-batches (a replay's, if the step turns out bad).
            step: the global step.
            epoch: the epoch.
        """
        skipper.leave_out_where(found[:2].isinf().any().float())  # non-finite values come as +inf
        self.late = _Late(pending, HostCopy(found), step, epoch)

    def take(self) -> Read | None:
        """The step left on the device, if any, read now (the copy has long finished) and taken off."""
        late, self.late = self.late, None
        if late is None:
            return None
        loss, grad_norm, flagged = read(late.found.read())
        return Read(late, math.isinf(loss), math.isinf(grad_norm), flagged)

    @staticmethod
    def settle(trainer: pl.Trainer, pl_module: pl.LightningModule, found: Read, replays: Replays,
               actions: Actions) -> None:
        """Report and act on what :meth:`take` read, as of its step.

        Args:
            trainer: the Trainer.
            pl_module: the LightningModule.
            found: what was read.
            replays: the detector's replays (the report).
            actions: the detector's actions (what is done about it).
        """
        if not (found.loss_bad or found.grad_bad):
            actions.good_step()
            return
        late = found.late
        # The weights are still those the bad step ran on: its update was left out on the device.
        with as_of_step(trainer, late.step):
            report = replays.report(trainer, pl_module, late.pending, found.loss_bad, None)
            actions.act(trainer, pl_module, dataclasses.replace(report, epoch=late.epoch), late=True)
