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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["HostCopy", "as_of_step", "takes_found_inf", "with_found_inf"]


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` leaves its update out on the device when given ``found_inf`` (fused optimizers).

    Example:
        >>> params = [torch.nn.Parameter(torch.ones(2))]
        >>> takes_found_inf(torch.optim.AdamW(params, fused=True)), takes_found_inf(torch.optim.AdamW(params))
        (True, False)
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def with_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor, step: Any, **kwargs: Any) -> Any:
    """Run ``step(**kwargs)`` with ``found_inf`` handed to the optimizer, as a GradScaler hands it, and take it back.

    Args:
        optimizer: a fused optimizer (:func:`takes_found_inf`).
        found_inf: a 0-d float32 tensor on the parameters' device: 1 leaves the update out, 0 applies it.
        step: the optimizer's own ``step``.
        kwargs: passed on to ``step``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=1.0, fused=True)
        >>> p.grad = torch.ones(2)
        >>> _ = with_found_inf(opt, torch.ones(()), opt.step)
        >>> p.tolist(), hasattr(opt, "found_inf")
        ([1.0, 1.0], False)
    """
    optimizer.found_inf, optimizer.grad_scale = found_inf, None  # type: ignore[attr-defined]
    try:
        return step(**kwargs)
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


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
