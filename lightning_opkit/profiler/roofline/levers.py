"""What to do about each op class of a window, in words, and the measurement each lever rests on.

A lever is only suggested where a measurement supports it: a lower precision only where its GEMM peak was measured
faster on this device, fusion only where the class is memory-bound and not fused already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_opkit.opclass import GEMM_CLASSES
from lightning_opkit.profiler.roofline.peaks import Peaks
from lightning_opkit.profiler.roofline.work import ClassRoofline

if TYPE_CHECKING:
    from lightning_opkit.profiler.roofline.report import RooflineReport

__all__ = ["block_glob", "lever"]

#: a lower precision counts as a lever only when its measured GEMM peak beats fp32's by this factor
_FASTER = 1.5


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
