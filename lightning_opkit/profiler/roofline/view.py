"""A window's roofline as a reader sees it: the table with each class's lever, the MFU line, the summary, the writes."""

from __future__ import annotations

from lightning_opkit.core.logging import LogWriter, markdown_table
from lightning_opkit.profiler.roofline.levers import lever
from lightning_opkit.profiler.roofline.plot import roofline_figure
from lightning_opkit.profiler.roofline.report import RooflineReport

__all__ = ["log_roofline", "mfu_line", "roofline_table", "summary_lines"]


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
        levers.append(f"- **{row.op_class}** ({ms:.3f} ms / step): {lever(row, report)}")
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
        what = "Inductor's fused kernels" if not any(r.unrecorded_calls for r in fused) else (
            "Ops whose work the trace does not record (Inductor's fused kernels, GEMMs missing an operand's shape)")
        text += (f"\n\n{what} (time in their class's ms / step, work not recorded, so not in the rates): "
                 + ", ".join(f"{r.op_class} {1e3 * r.unknown_seconds / steps:.3f} ms" for r in fused))
    return text + "\n\n" + mfu_line(report) + "\n\n**Levers**, from the measurements above:\n\n" + "\n".join(levers)


def _pct(value: float) -> str:
    """A share of a peak; above 100% it is no figure but a fault of the peak's measurement, and said so."""
    if value > 100:
        return f"{value:.0f}% (impossible: above 100% the measured peak is too low, a measurement fault)"
    return f"{value:.1f}%"


def _plausible(value: float | None) -> float | None:
    return value if value is not None and value <= 100 else None


def mfu_line(report: RooflineReport) -> str:
    """One line: the step's MFU against the peaks of the dtypes that ran, and against each of them where several ran.

    A dtype that did not run is no reference: its peak says nothing of this step (bf16's, emulated on a CPU without
    bf16 units, would put an fp32 step at many times 100%).
    """
    mix = report.mfu()
    if mix is None:
        return "MFU: no GEMM, convolution or attention ran in the window"
    flops = report.model_flops_by_dtype()
    ran = ", ".join(f"{d} {f / 1e9:.3g} GFLOP" for d, f in flops.items())
    line = (f"MFU {_pct(mix)} of the measured peak of the dtypes that ran ({ran} / step in"
            f" {1e3 * report.step_seconds:.2f} ms)")
    refs = [d for d in flops if d in report.peaks.gemm_tflops]
    if len(refs) > 1:
        line += "; against " + ", ".join(f"{d} {_pct(report.mfu(d) or 0.0)} ({report.peaks.gemm_tflops[d]:.3g}"
                                         " TFLOP/s)" for d in refs)
    return line


def summary_lines(report: RooflineReport) -> list[str]:
    """The run summary's two roofline lines: the step's MFU; the class with most time above its roof, its lever."""
    lines = ["  roofline: " + mfu_line(report)]
    lines += [f"  {d}'s measured peak looks disturbed ({why}): its shares are unreliable; measure on a quieter machine"
              for d, why in report.peaks.disturbed.items()]
    worst = report.worst()
    if worst is not None:
        kind, pct = worst.bound(report.peaks)
        said = lever(worst, report)
        bound = "" if said.startswith(f"{kind}-bound") else f", {kind}-bound at {pct:.0f}% of its roof"  # said once
        lines.append(f"  most time above its roof: {worst.op_class} ({1e3 * worst.seconds / report.steps:.3f} ms /"
                     f" step{bound}): {said}")
    return lines


def log_roofline(writer: LogWriter, report: RooflineReport, note: str, title: str, step: int) -> None:
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
    by_dtype = report.model_flops_by_dtype()
    flops = sum(by_dtype.values())
    # against a dtype's peak only where that dtype ran; a share above 100% is a measurement fault, not a figure
    writer.scalars("opkit/profiler", {
        "mfu": _plausible(report.mfu()),
        **{f"mfu_{d}": _plausible(report.mfu(d)) if d in by_dtype else None for d in ("fp32", "bf16")},
        "model_tflops": flops / report.step_seconds / 1e12 if flops and report.step_seconds else None}, step)
    writer.text("opkit/profiler/roofline", note + "\n\n" + roofline_table(report), step)
    figure = roofline_figure(report.rows, peaks, f"{title}: op classes against {peaks.device}'s measured roofs")
    writer.figure("opkit/profiler/roofline_plot", figure, step)
