"""Explicit rules' speed check: each lowered class timed at the ops and shapes the first training step ran."""

from __future__ import annotations

import time

import torch

from lightning_opkit.core.warn import warn_once
from lightning_opkit.precision.decide import MIN_SPEEDUP
from lightning_opkit.precision.dtypes import GOVERNED, describe_device, hardware_note
from lightning_opkit.precision.op_timing import time_classes
from lightning_opkit.precision.oplog import OpLog
from lightning_opkit.precision.results import PrecisionMeasurements, speed_phrase

__all__ = ["check_speed", "lowered"]


def lowered(table: dict[str, str]) -> list[str]:
    """The governed classes ``table`` runs in a 16-bit dtype.

    Example:
        >>> lowered({"matmul": "bf16", "norm": "fp32"})
        ['matmul']
    """
    return [c for c in GOVERNED if table.get(c) in ("bf16", "fp16")]


def check_speed(log: OpLog, device: torch.device, table: dict[str, str]) -> PrecisionMeasurements | None:
    """Time the lowered classes of ``table`` on the ops of ``log``; warn (rank zero) about those slower than fp32.

    Args:
        log: the ops the first training step ran, as recorded inside the policy's mode.
        device: where to time them.
        table: op class -> dtype name.

    Returns:
        The measurements (each class in the dtype of its own rule only), or ``None`` if timing failed.
    """
    classes = lowered(table)
    began = time.perf_counter()
    notes: list[str] = []
    try:
        rows = time_classes(log, device, sorted({table[c] for c in classes}), classes=classes, notes=notes)
    except Exception as err:  # timing must not end the run it times
        warn_once(f"PrecisionPolicy could not time this model's ops ({type(err).__name__}: {err}).")
        return None
    rows = [r for r in rows if r.dtype == table[r.op_class]]
    measurements = PrecisionMeasurements(rows, describe_device(device), seconds=time.perf_counter() - began,
                                         notes=notes)
    slow = [r for r in measurements if r.time_ratio is not None and r.time_ratio > MIN_SPEEDUP]
    if slow:
        parts = []
        for r in sorted(slow, key=lambda r: -(r.time_ratio or 0.0)):
            note = hardware_note(device, r.dtype)
            parts.append(f"{r.dtype} {r.op_class} is {speed_phrase(r)} than fp32" + (f" ({note})" if note else ""))
        warn_once(
            f"PrecisionPolicy: on this device ({describe_device(device, hardware=False)}), " + "; ".join(parts)
            + ". Measured at the shapes of this model's first training step, forward + backward. Use"
            " rules='auto' to choose each class's dtype by measurement, or set those classes to 'fp32';"
            " PrecisionPolicy(measure=False) turns this check off."
        )
    return measurements
