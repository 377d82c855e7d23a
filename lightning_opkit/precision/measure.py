"""Measure, on this device and this model, how fast and how accurate each op class is in each 16-bit dtype.

Speed: the ops the model ran on a real batch, at their shapes, timed forward + backward in fp32 and in each 16-bit
dtype (with the input casts the policy would add), weighted by how often the model calls them (:mod:`.op_timing`).
Error: the step run again with one class alone lowered to one dtype (everything else fp32): that class's outputs
against fp32 recomputes of the same ops, the loss against the fp32 loss, the gradients against the fp32 gradients
(:mod:`.runner`). :mod:`.results` holds what was measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn

from lightning_opkit.core.replay import loss_of, training_loss
from lightning_opkit.core.text import describe_error
from lightning_opkit.precision.census import Census
from lightning_opkit.precision.dtypes import GOVERNED, describe_device
from lightning_opkit.precision.op_timing import time_classes
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements
from lightning_opkit.precision.runner import StepRunner, device_of, grad_cosine, loss_change, record_ops

__all__ = ["Measurement", "PrecisionMeasurements", "measure_precision"]


def _default_loss(model: nn.Module, batch: Any) -> Tensor:
    if isinstance(model, pl.LightningModule):
        out = training_loss(model, batch, 0)
    elif isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (list, tuple)):
        out = model(*batch)
    else:
        out = model(batch)
    loss = loss_of(out)
    if loss is None or loss.numel() != 1:
        raise ValueError(
            f"measure_precision could not find a scalar loss in what {type(model).__name__} returned"
            f" ({type(out).__name__}); pass `loss_fn=lambda model, batch: ...` returning one."
        )
    return loss


def _usable_dtypes(device: torch.device) -> list[str]:
    # fp16 needs loss scaling; opkit offers it where a GradScaler is the norm (CUDA).
    return ["bf16", "fp16"] if device.type == "cuda" else ["bf16"]


def class_errors(runner: StepRunner, row: Measurement, ref_loss: Tensor, ref_grads: list[Tensor | None]) -> None:
    """Fill ``row``'s errors: the step with its class alone in its dtype, against the fp32 run."""
    census = Census()
    try:
        loss, grads = runner.run({row.op_class: row.dtype}, census=census)
    except Exception as err:
        row.failed = describe_error(err, 120)
        return
    errs = [r.rel_error for r in census.rows()
            if r.op_class == row.op_class and r.dtype == row.dtype and r.rel_error is not None]
    row.rel_error = max(errs) if errs else None
    row.loss_change = loss_change(loss, ref_loss)
    row.grad_cosine = grad_cosine(grads, ref_grads)


def check_arguments(model: nn.Module, device: torch.device | str | None, dtypes: Sequence[str] | None,
                    classes: Sequence[str] | None) -> tuple[torch.device, list[str]]:
    """The device and dtype names to measure with; ``ValueError`` naming what is wrong otherwise."""
    here = device_of(model)
    device = torch.device(device) if device is not None else here
    if device.type != here.type or (device.index is not None and here.index is not None and device != here):
        raise ValueError(f"measure_precision: the model is on {here}, not on device={device}; move it there first")
    names = list(dtypes) if dtypes is not None else _usable_dtypes(device)
    for name in names:
        if name not in ("bf16", "fp16"):
            raise ValueError(f"measure_precision: `dtypes` may hold 'bf16' and 'fp16', but got {name!r}")
    if classes is not None:
        unknown = [c for c in classes if c not in GOVERNED]
        if unknown:
            raise ValueError(f"measure_precision: unknown op classes {unknown}; valid classes are {list(GOVERNED)}")
    return device, names


def measure_precision(
    model: nn.Module,
    batch_fn: Callable[[], Any],
    device: torch.device | str | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    dtypes: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
    errors: bool = True,
    reps: int = 5,
    loss_scale: float | None = None,
) -> PrecisionMeasurements:
    """Measure each op class's speed and error in each 16-bit dtype, on this device and this model.

    The model's weights, buffers, gradients, metric states and the RNG are as before when it returns.

    Args:
        model: the model (a ``LightningModule``: its ``training_step`` gives the loss), on its training device.
        batch_fn: returns one real batch.
        device: where to run; the model must already be there. ``None`` = the device of its parameters.
        loss_fn: ``(model, batch) -> scalar loss``; ``None`` = ``training_step(batch, 0)`` of a LightningModule,
            else the model's output (a tensor, a dict's ``"loss"`` or an output's ``.loss``).
        dtypes: the 16-bit dtypes to measure; ``None`` = bf16, and fp16 on CUDA.
        classes: the op classes to measure; ``None`` = every governed class the model runs.
        errors: also measure errors (one extra forward + backward per class and dtype); speed only if ``False``.
        reps: timed repetitions per op shape (the median is kept).
        loss_scale: the GradScaler's scale where training scales the loss (fp16): gradients are compared as
            training gets them, scaled then unscaled, not underflowed.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        >>> table = measure_precision(model, lambda: torch.randn(8, 16), loss_fn=lambda m, b: m(b).square().mean())
        >>> table.classes
        ['matmul', 'norm', 'reduction', 'pointwise']
        >>> 0.99 < table.get("matmul", "bf16").grad_cosine <= 1.0 + 1e-6
        True
    """
    began = time.perf_counter()
    device, names = check_arguments(model, device, dtypes, classes)
    runner = StepRunner(model, move_data_to_device(batch_fn(), device), loss_fn or _default_loss, loss_scale)
    notes: list[str] = []
    with runner.session():
        log, ref_loss, ref_grads = record_ops(runner)
        rows = time_classes(log, device, names, classes, reps, notes)
        if errors:
            for row in rows:
                if row.failed is None:
                    class_errors(runner, row, ref_loss, ref_grads)
    if not rows:
        notes.append("the model ran no op of a governed class")
    return PrecisionMeasurements(rows, describe_device(device), float(ref_loss), time.perf_counter() - began, notes)
