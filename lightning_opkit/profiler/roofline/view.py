"""A window's roofline as a reader sees it: step MFU, per-class rates and bounds, the lever, the table and summary.

Trainer-free: built from :func:`~.work.class_rooflines` and the measured :class:`~.peaks.Peaks`. A lever is only
suggested where a measurement supports it: a lower precision only where its GEMM peak was measured faster on this
device, fusion only where the class is memory-bound and not fused already.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_opkit.core.logging import TensorBoardWriter
from lightning_opkit.core.text import markdown_table
from lightning_opkit.opclass import GEMM_CLASSES
from lightning_opkit.profiler.roofline.peaks import Peaks, measure_peaks
from lightning_opkit.profiler.roofline.plot import roofline_image
from lightning_opkit.profiler.roofline.work import ClassRoofline, class_rooflines

__all__ = ["RooflineReport", "block_glob", "build_report", "lever", "log_roofline", "roofline_table",
           "summary_lines"]

#: a lower precision counts as a lever only when its measured GEMM peak beats fp32's by this factor
_FASTER = 1.5


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
    """

    rows: dict[str, ClassRoofline]
    peaks: Peaks
    steps: int
    step_seconds: float
    exposed_communication_seconds: float = 0.0
    blocks: list[str] = field(default_factory=list)
    cuda: bool = False

    @property
    def compiled(self) -> bool:
        """Whether Inductor's fused kernels ran in the window."""
        return any(row.unknown_calls for row in self.rows.values())

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

    def lever(self, row: ClassRoofline) -> str:
        """The lever for ``row``, in words (see :func:`lever`)."""
        return lever(row, self)


def block_glob(blocks: list[str]) -> str | None:
    """One glob over the repeated blocks' paths (``["model.blocks.0", "model.blocks.1"]`` -> ``"model.blocks.*"``).

    Example:
        >>> block_glob(["model.blocks.0", "model.blocks.1"]), block_glob([])
        ('model.blocks.*', None)
    """
    heads = {b.rsplit(".", 1)[0] for b in blocks}
    if not blocks:
        return None
    return f"{heads.pop()}.*" if len(heads) == 1 else blocks[0]


def _compile_call(report: RooflineReport) -> str:
    """The TorchCompile to suggest: over the model's repeated blocks where it has them."""
    target = block_glob(report.blocks)
    return f"TorchCompile(modules=['{target}'])" if target else "TorchCompile()"


def _lower_precision(peaks: Peaks) -> tuple[str, float] | None:
    """The fastest 16-bit dtype whose measured GEMM peak beats fp32's by :data:`_FASTER`: ``(name, speedup)``."""
    fp32 = peaks.gemm_tflops.get("fp32", 0.0)
    best = max(((d, t / fp32) for d, t in peaks.gemm_tflops.items() if d in ("bf16", "fp16") and fp32),
               key=lambda kv: kv[1], default=None)
    return best if best is not None and best[1] >= _FASTER else None


def _gemm_lever(row: ClassRoofline, report: RooflineReport, kind: str, pct: float) -> str:
    peaks = report.peaks
    lower = _lower_precision(peaks)
    if kind == "memory":
        ridge = peaks.peak(row.dtype.split("+")[0]) / (peaks.bandwidth_gbps * 1e9)
        return (f"memory-bound at {row.intensity:.1f} FLOP/B, left of the ridge ({ridge:.1f} FLOP/B): larger GEMMs"
                " (a bigger batch or sequence) raise its intensity")
    if row.dtype.startswith("fp32") and lower is not None:
        name, speedup = lower
        pct_lower = 100 * row.tflops / peaks.gemm_tflops[name]
        return (f"in fp32 at {pct_lower:.0f}% of the measured {name} peak ({peaks.gemm_tflops[name]:.3g} TFLOP/s,"
                f" {speedup:.1f}x fp32's): PrecisionPolicy(rules={{'{row.op_class}': '{name}'}}) or rules='auto'")
    if row.dtype.startswith("fp32") and peaks.gemm_tflops.get("bf16"):
        slower = peaks.gemm_tflops["fp32"] / peaks.gemm_tflops["bf16"]
        if slower > 1:
            return (f"compute-bound at {pct:.0f}% of the fp32 peak; bf16 GEMMs measured {slower:.1f}x slower on this"
                    " device: no precision lever here")
    if pct >= 50:
        return f"compute-bound at {pct:.0f}% of its peak: near the roof; only less work helps"
    return (f"compute-bound at only {pct:.0f}% of its peak: small or oddly shaped GEMMs; a bigger batch, widths in"
            " multiples of 64")


def _overhead_lever(row: ClassRoofline, report: RooflineReport, pct: float) -> str:
    per_call = 1e6 * row.seconds / max(row.calls, 1)
    options = []
    if not report.compiled:
        options.append(_compile_call(report))
    if report.cuda:
        options.append("CUDA graphs (TorchCompile(mode='reduce-overhead'))")
    options.append("a bigger batch")
    return (f"overhead-bound: {row.calls / report.steps:.0f} calls / step of {per_call:.1f} us each, at {pct:.1f}%"
            f" of its roof: fewer, larger ops: " + ", ".join(options))


def lever(row: ClassRoofline, report: RooflineReport) -> str:
    """What to do about ``row``, with the measurement that supports it; no lever the measurement does not support.

    Args:
        row: one class of the window.
        report: the window (peaks, whether compiled, the model's blocks).
    """
    peaks = report.peaks
    if row.op_class == "communication":
        return _communication_lever(row, report)
    if row.seconds <= 0:
        return "fused by Inductor: its work is not in the trace"
    kind, pct = row.bound(peaks)
    if kind == "dispatch":
        return ("no op of this class did work of its own: its time is dispatch around ops counted in their classes"
                " (attention's math path: matmul, softmax)")
    if kind == "overhead":
        return _overhead_lever(row, report, pct)
    text = _gemm_lever(row, report, kind, pct) if row.op_class in GEMM_CLASSES else _elementwise_lever(
        row, report, kind, pct)
    if pct < 10:
        text += (f"; at only {pct:.1f}% of its roof in ops of {1e3 * row.seconds / row.calls:.2f} ms each, which is"
                 " not launch cost: slow kernels (see this class's ops in top_ops: strided or broadcast inputs, a"
                 " fallback path, first-touch page faults of fresh outputs on CPU)")
    return text


def _elementwise_lever(row: ClassRoofline, report: RooflineReport, kind: str, pct: float) -> str:
    peaks = report.peaks
    if kind == "memory" and not report.compiled:
        return (f"memory-bound at {row.pct_bandwidth(peaks):.0f}% of the measured bandwidth"
                f" ({peaks.bandwidth_gbps:.1f} GB/s): fuse it with its neighbours: {_compile_call(report)}")
    if kind == "memory":
        return (f"memory-bound at {row.pct_bandwidth(peaks):.0f}% of the measured bandwidth, after fusion: fewer"
                " bytes (smaller activations) is what is left")
    return f"compute-bound at {pct:.0f}% of the GEMM peak: unusual for {row.op_class}; check its op mix"


def _communication_lever(row: ClassRoofline, report: RooflineReport) -> str:
    link = report.peaks.link_gbps
    share = 100 * report.exposed_communication_seconds / report.steps / report.step_seconds if \
        report.step_seconds else 0.0
    pct = 100 * row.gbps / link if link else None
    rate = f"{row.gbps:.3g} GB/s" + (f", {pct:.0f}% of the measured all_reduce {link:.3g} GB/s" if link else "")
    per_call = row.bytes / max(row.calls, 1) / 1e3
    if pct is not None and pct < 10:
        return (f"latency-bound: {row.calls / report.steps:.0f} collective(s) / step of {per_call:.1f} kB at {rate};"
                f" {share:.0f}% of the step waits on it: fewer, larger messages (larger DDP buckets, gradient"
                " accumulation)")
    if share >= 10:
        return (f"{share:.0f}% of the step waits on communication ({rate}): overlap it (larger DDP buckets, FSDP2"
                " prefetch) or communicate less often (gradient accumulation)")
    return f"mostly hidden behind compute: {share:.0f}% of the step waits on it ({rate})"


def roofline_table(report: RooflineReport) -> str:
    """The window's roofline: the peaks, a table of rates and bounds per class, each class's lever, the MFU.

    Args:
        report: the window.
    """
    peaks, steps = report.peaks, report.steps
    headers = ["class", "dtype", "ms / step", "GFLOP / step", "MB / step", "FLOP / B", "TFLOP/s", "GB/s",
               "% GEMM peak", "% bandwidth", "bound"]
    rows, levers = [], []
    for row in sorted(report.rows.values(), key=lambda r: -(r.seconds + r.unknown_seconds)):
        ms = 1e3 * (row.seconds + row.unknown_seconds) / steps
        levers.append(f"- **{row.op_class}** ({ms:.3f} ms / step): {report.lever(row)}")
        if row.op_class == "communication":
            rows.append([row.op_class, "-", ms, "-", row.bytes / 1e6 / steps, "-", "-", row.gbps, "-", "-", "link"])
            continue
        kind = row.bound(peaks)[0] if row.seconds else "fused"
        rows.append([row.op_class, row.dtype, ms, row.flops / 1e9 / steps, row.bytes / 1e6 / steps, row.intensity,
                     row.tflops, row.gbps, row.pct_peak(peaks), row.pct_bandwidth(peaks), kind])
    text = f"Peaks {peaks.describe()}.\n\n" + markdown_table(headers, rows)
    if any(r.pct_bandwidth(peaks) > 100 for r in report.rows.values() if r.op_class != "communication"):
        text += ("\n\nAbove 100% of the bandwidth: that class's data was served from cache, faster than the large"
                 " copy the bandwidth roof was measured with.")
    fused = [r for r in report.rows.values() if r.unknown_calls]
    if fused:
        text += ("\n\nInductor's fused kernels (time in their class's ms / step, work not recorded, so not in the"
                 " rates): " + ", ".join(f"{r.op_class} {1e3 * r.unknown_seconds / steps:.3f} ms" for r in fused))
    return text + "\n\n" + mfu_line(report) + "\n\n**Levers**, from the measurements above:\n\n" + "\n".join(levers)


def mfu_line(report: RooflineReport) -> str:
    """One line: the step's MFU against the dtype mix, and against fp32's and bf16's peaks."""
    mix = report.mfu()
    if mix is None:
        return "MFU: no GEMM, convolution or attention ran in the window"
    flops = report.model_flops_by_dtype()
    ran = ", ".join(f"{d} {f / 1e9:.3g} GFLOP" for d, f in flops.items())
    refs = ", ".join(f"{d} {report.mfu(d):.1f}% ({report.peaks.gemm_tflops[d]:.3g} TFLOP/s)"
                     for d in ("fp32", "bf16") if d in report.peaks.gemm_tflops)
    return (f"MFU {mix:.1f}% of the measured peak of the dtypes that ran ({ran} / step in"
            f" {1e3 * report.step_seconds:.2f} ms); against {refs}")


def summary_lines(report: RooflineReport) -> list[str]:
    """The run summary's two roofline lines: the step's MFU; the class with most time above its roof, its lever."""
    lines = ["  roofline: " + mfu_line(report)]
    worst = report.worst()
    if worst is not None:
        kind, pct = worst.bound(report.peaks)
        lines.append(f"  most time above its roof: {worst.op_class} ({1e3 * worst.seconds / report.steps:.3f} ms /"
                     f" step, {kind}-bound at {pct:.0f}% of its roof): {report.lever(worst)}")
    return lines


def build_report(prof: Any, steps: int, step_seconds: float, *, device: Any, communication_seconds: float = 0.0,
                 exposed_communication_seconds: float = 0.0, link_gbps: float | None = None,
                 blocks: list[str] | None = None, cuda: bool = False) -> RooflineReport:
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
    """
    rows = class_rooflines(prof, use_device=cuda)
    if "communication" in rows:
        rows["communication"].seconds = communication_seconds
    ran = tuple(d for r in rows.values() for d in r.flops_by_dtype)
    peaks = measure_peaks(device, ("fp32", "bf16", *ran), link_gbps=link_gbps)
    return RooflineReport(rows, peaks, steps, step_seconds, exposed_communication_seconds, blocks or [], cuda)


def log_roofline(writer: TensorBoardWriter, report: RooflineReport, note: str, title: str, step: int) -> None:
    """Write a window's roofline: per-class and MFU scalars, the table (text) and the picture (image).

    Args:
        writer: the run's writer (rank zero).
        report: the window.
        note: the window's heading, above the table.
        title: the picture's title (the window and step); the device is added.
        step: the global step.
    """
    peaks = report.peaks
    for cls, row in report.rows.items():
        if cls == "communication":
            writer.scalars("opkit/profiler/communication", {
                "gbps": row.gbps, "pct_link": 100 * row.gbps / peaks.link_gbps if peaks.link_gbps else None}, step)
        elif row.seconds > 0:
            writer.scalars(f"opkit/profiler/{cls}", {
                "tflops": row.tflops, "gbps": row.gbps, "pct_peak": row.pct_peak(peaks),
                "pct_bandwidth": row.pct_bandwidth(peaks), "intensity": row.intensity}, step)
    flops = sum(report.model_flops_by_dtype().values())
    writer.scalars("opkit/profiler", {
        "mfu": report.mfu(), "mfu_fp32": report.mfu("fp32"), "mfu_bf16": report.mfu("bf16"),
        "model_tflops": flops / report.step_seconds / 1e12 if flops and report.step_seconds else None}, step)
    writer.text("opkit/profiler/roofline", note + "\n\n" + roofline_table(report), step)
    picture = roofline_image(report.rows, peaks, f"{title}: op classes against {peaks.device}'s measured roofs")
    writer.image("opkit/profiler/roofline_plot", picture, step)
