"""The roofline picture: arithmetic intensity against achieved TFLOP/s, one point per op class, the roofs drawn.

Drawn with Pillow (which TensorBoard itself needs) on log-log axes: one roof per measured GEMM dtype (the
bandwidth diagonal, then that dtype's flat peak). Returned as an ``(H, W, 3)`` uint8 array for ``add_image``.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.work import ClassRoofline

__all__ = ["roofline_image"]

_W, _H = 900, 560
_LEFT, _RIGHT, _TOP, _BOTTOM = 80, 230, 40, 60
_ROOF_COLORS = {"fp32": (31, 119, 180), "bf16": (214, 39, 40), "fp16": (148, 103, 189), "fp64": (127, 127, 127)}
# the points' colours are none of the roofs'
_POINT_COLORS = [(255, 127, 14), (44, 160, 44), (23, 190, 207), (188, 189, 34), (227, 119, 194), (140, 86, 75),
                 (0, 0, 0), (255, 187, 120), (152, 223, 138), (0, 128, 128), (128, 0, 64), (174, 199, 232)]


class _Axes:
    """Log-log mapping of (FLOP/B, TFLOP/s) to pixels."""

    def __init__(self, x_range: tuple[float, float], y_range: tuple[float, float]) -> None:
        self.x0, self.x1 = (math.log10(v) for v in x_range)
        self.y0, self.y1 = (math.log10(v) for v in y_range)

    def __call__(self, x: float, y: float) -> tuple[float, float]:
        fx = (math.log10(x) - self.x0) / (self.x1 - self.x0)
        fy = (math.log10(y) - self.y0) / (self.y1 - self.y0)
        return _LEFT + fx * (_W - _LEFT - _RIGHT), _H - _BOTTOM - fy * (_H - _TOP - _BOTTOM)


def _ranges(points: list[ClassRoofline], peaks: Peaks) -> tuple[tuple[float, float], tuple[float, float]]:
    bandwidth = peaks.bandwidth_gbps * 1e9
    ridges = [peaks.peak(d) / bandwidth for d in peaks.gemm_tflops]
    xs = [p.intensity for p in points] + ridges
    ys = [p.tflops for p in points] + list(peaks.gemm_tflops.values())
    x_range = (10 ** math.floor(math.log10(min(xs)) - 0.5), 10 ** math.ceil(math.log10(max(xs)) + 0.5))
    y_range = (10 ** math.floor(math.log10(min(ys)) - 0.5), 10 ** math.ceil(math.log10(max(ys)) + 0.3))
    return x_range, y_range


def _grid(draw: ImageDraw.ImageDraw, axes: _Axes, font: ImageFont.ImageFont) -> None:
    for e in range(math.floor(axes.x0), math.ceil(axes.x1) + 1):
        x, _ = axes(10.0**e, 10**axes.y0)
        draw.line([(x, _TOP), (x, _H - _BOTTOM)], fill=(225, 225, 225))
        draw.text((x, _H - _BOTTOM + 6), f"1e{e}", fill="black", font=font, anchor="mt")
    for e in range(math.floor(axes.y0), math.ceil(axes.y1) + 1):
        _, y = axes(10**axes.x0, 10.0**e)
        draw.line([(_LEFT, y), (_W - _RIGHT, y)], fill=(225, 225, 225))
        draw.text((_LEFT - 6, y), f"1e{e}", fill="black", font=font, anchor="rm")
    draw.rectangle([(_LEFT, _TOP), (_W - _RIGHT, _H - _BOTTOM)], outline="black")
    draw.text(((_LEFT + _W - _RIGHT) / 2, _H - 22), "arithmetic intensity (FLOP / byte)", fill="black", font=font,
              anchor="mm")



def _y_label(image: Image.Image, font: ImageFont.ImageFont) -> None:
    # rotated, left of the tick labels, so the two never overlap
    label = Image.new("RGB", (160, 18), "white")
    ImageDraw.Draw(label).text((80, 9), "achieved TFLOP/s", fill="black", font=font, anchor="mm")
    rotated = label.rotate(90, expand=True)
    image.paste(rotated, (4, int((_TOP + _H - _BOTTOM) / 2 - rotated.height / 2)))


def _roofs(draw: ImageDraw.ImageDraw, axes: _Axes, peaks: Peaks, font: ImageFont.ImageFont) -> None:
    bandwidth = peaks.bandwidth_gbps * 1e9
    x_lo, x_hi = 10**axes.x0, 10**axes.x1
    legend_y = _TOP + 4
    for dtype, tflops in sorted(peaks.gemm_tflops.items(), key=lambda kv: -kv[1]):
        ridge = tflops * 1e12 / bandwidth
        color = _ROOF_COLORS.get(dtype, (0, 0, 0))
        start = max(x_lo, 10**axes.y0 * 1e12 / bandwidth)
        if ridge > start:
            draw.line([axes(start, start * bandwidth / 1e12), axes(ridge, tflops)], fill=color, width=2)
        draw.line([axes(max(ridge, x_lo), tflops), axes(x_hi, tflops)], fill=color, width=2)
        draw.text((_W - _RIGHT + 10, legend_y), f"{dtype} GEMM {tflops:.3g} TFLOP/s", fill=color, font=font)
        legend_y += 18
    draw.text((_W - _RIGHT + 10, legend_y), f"copy {peaks.bandwidth_gbps:.1f} GB/s", fill="black", font=font)


def roofline_image(rows: dict[str, ClassRoofline], peaks: Peaks, title: str) -> np.ndarray:
    """One window's roofline picture; classes with no FLOPs or no bytes (a copy, an embedding) cannot be placed.

    Args:
        rows: per op class.
        peaks: the measured roofs.
        title: drawn at the top (the window, the device).

    Example:
        >>> from lightning_opkit.profiler.roofline.peaks import Peaks
        >>> from lightning_opkit.profiler.roofline.work import ClassRoofline
        >>> peaks = Peaks("cpu", {"fp32": 0.1}, 40.0)
        >>> row = ClassRoofline("matmul", {"fp32": 2e9}, bytes=1e7, seconds=0.04, calls=4)
        >>> roofline_image({"matmul": row}, peaks, "window 1").shape
        (560, 900, 3)
    """
    points = [r for r in rows.values() if r.flops > 0 and r.bytes > 0 and r.seconds > 0]
    image = Image.new("RGB", (_W, _H), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=13)
    draw.text((_LEFT, 12), title, fill="black", font=font)
    if not points or not peaks.gemm_tflops:
        draw.text((_LEFT, _H / 2), "no op with both FLOPs and bytes recorded in this window", fill="black", font=font)
        return np.asarray(image)
    axes = _Axes(*_ranges(points, peaks))
    _grid(draw, axes, font)
    _y_label(image, font)
    _roofs(draw, axes, peaks, font)
    legend_y = _TOP + 24 + 18 * len(peaks.gemm_tflops)
    for i, row in enumerate(sorted(points, key=lambda r: -r.seconds)):
        color = _POINT_COLORS[i % len(_POINT_COLORS)]
        x, y = axes(row.intensity, row.tflops)
        draw.ellipse([(x - 6, y - 6), (x + 6, y + 6)], fill=color, outline="black")
        draw.text((x + 9, y), row.op_class, fill="black", font=font, anchor="lm")
        draw.text((_W - _RIGHT + 10, legend_y), f"{row.op_class} ({row.dtype}) {row.tflops:.3g} TFLOP/s", fill=color,
                  font=font)
        legend_y += 18
    return np.asarray(image)
