"""The roofline picture: arithmetic intensity against achieved TFLOP/s, one point per op class, the roofs drawn.

A matplotlib figure on log-log axes: one roof per measured GEMM dtype (the bandwidth diagonal up to the ridge, then
that dtype's flat peak) and a point per op class with both FLOPs and bytes. TensorBoard takes it through
``add_figure``.
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.work import ClassRoofline

__all__ = ["roofline_figure"]

#: 900 x 560 pixels at matplotlib's 100 dpi
_SIZE = (9.0, 5.6)
_ROOF_COLORS = {"fp32": "tab:blue", "bf16": "tab:red", "fp16": "tab:purple", "fp64": "tab:gray"}
# the points' colours are none of the roofs'
_POINT_COLORS = ("tab:orange", "tab:green", "tab:cyan", "tab:olive", "tab:pink", "tab:brown", "black", "gold",
                 "teal", "navy", "lime", "maroon")


def roofline_figure(rows: dict[str, ClassRoofline], peaks: Peaks, title: str) -> Figure:
    """One window's roofline picture; classes with no FLOPs or no bytes (a copy, an embedding) cannot be placed.

    Args:
        rows: per op class.
        peaks: the measured roofs.
        title: the figure's title (the window, the device).

    Example:
        >>> peaks = Peaks("cpu", {"fp32": 0.1}, 40.0)
        >>> row = ClassRoofline("matmul", {"fp32": 2e9}, bytes=1e7, seconds=0.04, calls=4)
        >>> figure = roofline_figure({"matmul": row}, peaks, "window 1")
        >>> [text.get_text() for text in figure.axes[0].get_legend().get_texts()][:2]
        ['fp32 GEMM 0.1 TFLOP/s', 'copy 40.0 GB/s']
    """
    figure = Figure(figsize=_SIZE, dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(title, fontsize=10, loc="left")
    points = [r for r in rows.values() if r.flops > 0 and r.bytes > 0 and r.seconds > 0]
    if not points or not peaks.gemm_tflops:
        axes.set_axis_off()
        axes.text(0.5, 0.5, "no op with both FLOPs and bytes recorded in this window", ha="center", va="center")
        return figure
    bandwidth = peaks.bandwidth_gbps * 1e9 / 1e12  # TB/s: TFLOP/s per FLOP/byte
    ridges = [t / bandwidth for t in peaks.gemm_tflops.values()]
    xs = [p.intensity for p in points] + ridges
    x_lo, x_hi = min(xs) / 4, max(xs) * 4
    for dtype, tflops in sorted(peaks.gemm_tflops.items(), key=lambda kv: -kv[1]):
        ridge = tflops / bandwidth
        color = _ROOF_COLORS.get(dtype, "black")
        axes.plot([x_lo, ridge, x_hi], [min(x_lo * bandwidth, tflops), tflops, tflops], color=color, linewidth=2,
                  label=f"{dtype} GEMM {tflops:.3g} TFLOP/s")
    axes.plot([], [], color="none", label=f"copy {peaks.bandwidth_gbps:.1f} GB/s")
    for i, row in enumerate(sorted(points, key=lambda r: -r.seconds)):
        axes.scatter([row.intensity], [row.tflops], s=60, color=_POINT_COLORS[i % len(_POINT_COLORS)],
                     edgecolors="black", zorder=3,
                     label=f"{row.op_class} ({row.dtype}) {row.tflops:.3g} TFLOP/s")
        axes.annotate(row.op_class, (row.intensity, row.tflops), xytext=(6, 0), textcoords="offset points",
                      va="center", fontsize=9)
    axes.set_xscale("log")
    axes.set_yscale("log")
    # plain tick labels: matplotlib's default log labels go through its TeX-like parser on every draw
    for axis in (axes.xaxis, axes.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.set_xlim(x_lo, x_hi)
    axes.set_xlabel("arithmetic intensity (FLOP / byte)")
    axes.set_ylabel("achieved TFLOP/s")
    axes.grid(True, which="major", color="0.9")
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return figure
