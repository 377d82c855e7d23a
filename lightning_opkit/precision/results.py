"""What ``rules="auto"`` measured: a :class:`Measurement` per op class and dtype, and the sensitivity table."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

from lightning_opkit.core.deprecations import OpkitDeprecationWarning
from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.text import times_phrase
from lightning_opkit.opclass import OP_CLASSES

__all__ = ["Measurement", "PrecisionMeasurements", "speed_phrase"]


@dataclass
class Measurement:
    """One class in one dtype: speed against fp32 and the error of running that class alone in that dtype.

    Args:
        op_class: the op class.
        dtype: ``"bf16"`` or ``"fp16"``.
        time_ratio: time in ``dtype`` / time in fp32, forward + backward with input casts (below 1 = faster, 2.0 =
            twice as slow); ``None`` if not measured. (Was ``speed``, read-only now, deprecated.)
        rel_error: ``||out - ref|| / ||ref||`` of the class's outputs against fp32 recomputes of the same ops.
        loss_change: ``|loss - loss_fp32| / |loss_fp32|`` with this class alone in ``dtype``.
        grad_cosine: cosine similarity of all parameter gradients to the fp32 gradients.
        fp32_ms: the class's measured fp32 time per step (forward + backward), for weighting.
        calls: the class's ops per forward.
        failed: why the class could not run in ``dtype``, if it could not.
    """

    op_class: str
    dtype: str
    time_ratio: float | None = None
    rel_error: float | None = None
    loss_change: float | None = None
    grad_cosine: float | None = None
    fp32_ms: float | None = None
    calls: int = 0
    failed: str | None = None

    @property
    def speed(self) -> float | None:
        """Deprecated: :attr:`time_ratio` (a time ratio: above 1 is slower, which ``speed`` did not say)."""
        warnings.warn("Measurement.speed is deprecated and will be removed in the next release: use"
                      " Measurement.time_ratio (the same value: time in the dtype / time in fp32)",
                      OpkitDeprecationWarning, stacklevel=2)
        return self.time_ratio


@dataclass
class PrecisionMeasurements:
    """The sensitivity table of one model on one device: a :class:`Measurement` per (op class, dtype).

    Args:
        rows: the measurements.
        device: a description of the device they were taken on.
        loss: the fp32 loss of the measured batch.
        seconds: what measuring cost, wall clock.
        notes: what could not be measured, and why.
    """

    rows: list[Measurement]
    device: str = ""
    loss: float = math.nan
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self.rows)

    def get(self, op_class: str, dtype: str) -> Measurement | None:
        """The row of ``op_class`` in ``dtype``, if measured."""
        return next((r for r in self.rows if r.op_class == op_class and r.dtype == dtype), None)

    @property
    def classes(self) -> list[str]:
        """The op classes measured, in taxonomy order."""
        return sorted({r.op_class for r in self.rows}, key=OP_CLASSES.index)

    def table(self, chosen: dict[str, str] | None = None) -> str:
        """The sensitivity table as markdown, costliest class first; ``chosen``: op class -> dtype, marked.

        Args:
            chosen: the dtype decided per class, if any.
        """
        rows = sorted(self.rows, key=lambda r: (-(r.fp32_ms or 0.0), r.op_class, r.dtype))
        body = [[r.op_class, r.dtype, r.calls, r.fp32_ms, speed_phrase(r), _fmt(r.rel_error, ".2e"),
                 _fmt(r.loss_change, ".2e"), _fmt(r.grad_cosine, ".6f"),
                 ("yes" if chosen.get(r.op_class) == r.dtype else "no") if chosen is not None else "-"]
                for r in rows]
        text = markdown_table(["op class", "dtype", "ops / step", "fp32 ms / step", "speed vs fp32",
                               "output rel. error", "loss change", "grad cosine", "chosen"], body)
        return f"Measured in {self.seconds:.2f} s on {self.device}.\n\n{text}"

    def __str__(self) -> str:
        return self.table()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def speed_phrase(row: Measurement) -> str:
    """``"11.2x slower"`` or ``"1.8x faster"`` for a measured row (``"-"`` if not measured)."""
    if row.failed:
        return f"failed: {row.failed}"
    if row.time_ratio is None:
        return "-"
    return times_phrase(row.time_ratio)
