"""A window's roofline as measured: per-class rows, the peaks they are judged against, the step's time and MFU.

Trainer-free: :func:`build_report` turns a stopped profiler into a :class:`RooflineReport` (work per class from
:mod:`.work`, peaks from :mod:`.peaks`); :mod:`.levers` says what to do about each class, :mod:`.view` shows it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_opkit.core.facts import RunFacts
from lightning_opkit.opclass import GEMM_CLASSES
from lightning_opkit.profiler.roofline.gemm_speed import gemm_speed
from lightning_opkit.profiler.roofline.layout_speed import conv_layout_speed
from lightning_opkit.profiler.roofline.peaks import Peaks, checked_peaks, measure_peaks
from lightning_opkit.profiler.roofline.work import ClassRoofline, achieved_rates, class_rooflines

__all__ = ["RooflineReport", "build_report"]


@dataclass
class RooflineReport:
    """One window's roofline: per-class rows, the peaks they are judged against, the step's time and MFU.

    Args:
        rows: per op class, from ``class_rooflines`` (``communication``'s seconds set from the window's wall time).
        peaks: this device's measured peaks.
        steps: recorded steps in the window.
        step_seconds: mean wall time of a recorded step.
        exposed_communication_seconds: communication wall time per window not hidden behind compute.
        blocks: the model's repeated blocks (``find_blocks``), named in the fusion lever.
        cuda: whether the window ran on a GPU (CUDA graphs are a lever there only).
        facts: what this run measured (the kit's shared facts): the levers rest on them.
    """

    rows: dict[str, ClassRoofline]
    peaks: Peaks
    steps: int
    step_seconds: float
    exposed_communication_seconds: float = 0.0
    blocks: list[str] = field(default_factory=list)
    cuda: bool = False
    facts: RunFacts | None = None

    @property
    def compiled(self) -> bool:
        """Whether Inductor's fused kernels ran in the window."""
        return any(row.unknown_calls > row.unrecorded_calls for row in self.rows.values())

    def model_flops_by_dtype(self) -> dict[str, float]:
        """FLOPs per step of the GEMM-like classes (matmul, conv, attention, rnn), per dtype they ran in."""
        total: dict[str, float] = {}
        for cls in GEMM_CLASSES:
            for dtype, flops in self.rows[cls].flops_by_dtype.items() if cls in self.rows else ():
                total[dtype] = total.get(dtype, 0.0) + flops / self.steps
        return total

    def mfu(self, against: str | None = None) -> float | None:
        """Step MFU in percent: model FLOPs over step time against the peak of the dtypes that ran, or of ``against``.

        Against the mix, each dtype's FLOPs are charged at that dtype's measured peak: 100% is a step that spent
        all its time in GEMMs at their peaks. Model FLOPs are the GEMM-like classes' as run (a recomputed forward
        counts). ``None`` when the step ran no such op or a peak is unknown.
        """
        flops = self.model_flops_by_dtype()
        if not flops or self.step_seconds <= 0:
            return None
        if against is not None:
            peak = self.peaks.gemm_tflops.get(against)
            return 100 * sum(flops.values()) / (peak * 1e12) / self.step_seconds if peak else None
        seconds = sum(f / self.peaks.peak(d) for d, f in flops.items() if self.peaks.peak(d) > 0)
        return 100 * seconds / self.step_seconds

    def worst(self) -> ClassRoofline | None:
        """The class with the most time above its roof (communication and classes with no work of their own apart)."""
        rows = [r for c, r in self.rows.items() if c != "communication" and r.seconds > 0 and r.calls]
        return max(rows, key=lambda r: r.lost_seconds(self.peaks), default=None)


def build_report(prof: Any, steps: int, step_seconds: float, *, device: Any, communication_seconds: float = 0.0,
                 exposed_communication_seconds: float = 0.0, link_gbps: float | None = None,
                 blocks: list[str] | None = None, cuda: bool = False, facts: RunFacts | None = None,
                 window: int = 0, conv_layout: str = "contiguous") -> RooflineReport:
    """A stopped window's roofline: work per class from the trace, peaks measured (once per process) for its dtypes.

    Args:
        prof: the stopped profiler (``record_shapes`` and ``with_flops`` on).
        steps: recorded steps.
        step_seconds: mean wall time of a recorded step.
        device: the training device, where the peaks are measured.
        communication_seconds: the window's communication wall time (its intervals merged).
        exposed_communication_seconds: the part of it no compute overlapped.
        link_gbps: the process group's measured all_reduce bandwidth.
        blocks: the model's repeated blocks, for the fusion lever.
        cuda: the window ran on a GPU (device self times).
        facts: the run's shared facts: the peaks go there, and, where no precision policy runs, the window's own
            bf16 timing at its GEMM shapes (once a run); where convolutions ran, their channels_last timing (once).
        window: the window's number (for the facts' sources).
        conv_layout: the layout the model's convolutions run in (``"contiguous"`` or ``"channels_last"``).
    """
    rows = class_rooflines(prof, use_device=cuda)
    if "communication" in rows:
        rows["communication"].seconds = communication_seconds
    ran = tuple(d for r in rows.values() for d in r.flops_by_dtype)
    peaks = measure_peaks(device, ("fp32", "bf16", *ran), link_gbps=link_gbps)
    peaks = checked_peaks(peaks, achieved_rates(rows), device)
    if facts is not None:
        facts.peaks = peaks
        matmul = rows.get("matmul")
        unmeasured = "matmul" not in facts.dtypes and facts.speed("matmul") is None
        if matmul is not None and matmul.dtype.startswith("fp32") and unmeasured:
            found = gemm_speed(prof, device, window, use_device=cuda)
            if found is not None:
                facts.speeds[("matmul", found.dtype)] = found
        if "conv" in rows and "conv" not in facts.layouts:
            layout = conv_layout_speed(prof, device, window, current=conv_layout, use_device=cuda)
            if layout is not None:
                facts.layouts["conv"] = layout
    return RooflineReport(rows, peaks, steps, step_seconds, exposed_communication_seconds, blocks or [], cuda, facts)
