"""What to do about each op class of a window, in words, and the measurement each lever rests on.

A lever is only suggested where a measurement of this run supports it, and it names that measurement (the run's
shared facts, :mod:`lightning_opkit.core.facts`): a lower precision only where a 16-bit time measured at this model's
shapes beats fp32 (by a precision policy, else by the roofline itself), never for a class a policy measured and kept
in fp32; fusion only where the class is memory-bound and nothing is compiled yet.
"""

from __future__ import annotations

from lightning_opkit.core.facts import FASTER
from lightning_opkit.opclass import GEMM_CLASSES
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.work import ClassRoofline

__all__ = ["block_glob", "fp8_lever", "layout_lever", "lever", "precision_lever"]



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


def precision_lever(row: ClassRoofline, report: RooflineReport) -> tuple[bool, str] | None:
    """``(actionable, words)`` about running an fp32 class in 16-bit, from this run's measurements; ``None``: none.

    A precision policy that decides the class has the last word: what it runs in fp32 it measured (or was told) to.
    Without one, a 16-bit time measured at this model's shapes (the roofline's own, from the window's GEMMs) decides.
    """
    facts = report.facts
    if facts is None or not row.dtype.startswith("fp32"):
        return None
    cls = row.op_class
    speed = facts.speed(cls)
    if cls in facts.dtypes:  # a precision policy decides it, and runs it in fp32
        why = facts.kept_fp32.get(cls)
        if speed is not None and speed.faster and why:  # faster alone, slower in the step: the step decided
            evidence = f"{why}; alone, {speed.phrase()}"
        else:
            evidence = speed.phrase() if speed is not None else why or "its rules"
        return False, f"kept in fp32 by the precision policy ({evidence}): no precision lever"
    if speed is None:
        return None
    if speed.ratio * FASTER <= 1:
        return True, f"{speed.phrase()}: PrecisionPolicy(rules={{'{cls}': '{speed.dtype}'}}) or rules='auto'"
    return False, f"{speed.phrase()}: no precision lever here"


def _with_precision(text: str, row: ClassRoofline, report: RooflineReport) -> str:
    """``text``, and what this run measured about the class in 16-bit (or float8), where it measured anything."""
    precision = precision_lever(row, report) if row.op_class in GEMM_CLASSES else None
    return _with_fp8(text if precision is None else f"{text}; {precision[1]}", row, report)


def _with_fp8(text: str, row: ClassRoofline, report: RooflineReport) -> str:
    fp8 = fp8_lever(row, report)
    return text if fp8 is None else f"{text}; {fp8}"


def fp8_lever(row: ClassRoofline, report: RooflineReport) -> str | None:
    """What ``rules="auto"`` measured of the matmul class's Linears in float8, where it did; ``None`` otherwise.

    Only from a measurement at the model's rows: float8 pays for wide GEMMs and loses for narrow ones, so no square
    GEMM's peak and no datasheet speaks for it.
    """
    fp8 = report.facts.fp8 if report.facts is not None else None
    if fp8 is None or row.op_class != "matmul":
        return None
    return fp8.phrase()


def _gemm_lever(row: ClassRoofline, report: RooflineReport, kind: str, pct: float) -> str:
    peaks = report.peaks
    if kind == "memory":
        ridge = peaks.peak(row.dtype.split("+")[0]) / (peaks.bandwidth_gbps * 1e9)
        return _with_precision(f"memory-bound at {row.intensity:.1f} FLOP/B, left of the ridge ({ridge:.1f} FLOP/B):"
                               " larger GEMMs (a bigger batch or sequence) raise its intensity", row, report)
    precision = precision_lever(row, report)
    if precision is not None and precision[0]:
        return _with_fp8(f"compute-bound at {pct:.0f}% of its fp32 peak; {precision[1]}", row, report)
    if pct >= 50:
        text = f"compute-bound at {pct:.0f}% of its peak: near the roof; only less work helps"
    else:
        text = (f"compute-bound at only {pct:.0f}% of its peak: small or oddly shaped GEMMs; a bigger batch, widths in"
                " multiples of 64")
    return _with_fp8(text + (f"; {precision[1]}" if precision is not None else ""), row, report)


def _compiled(report: RooflineReport) -> bool:
    """Whether the model is compiled already: fused kernels ran in the window, or TorchCompile compiled regions."""
    return report.compiled or bool(report.facts is not None and report.facts.compiled)


def _eager_note(report: RooflineReport) -> str:
    """Regions TorchCompile runs eagerly because compiled measured slower: said wherever fusion would be suggested."""
    eager = report.facts.eager_regions if report.facts is not None else {}
    if not eager:
        return ""
    shown = ", ".join(f"{name} ({speed:.2f}x)" for name, speed in list(eager.items())[:3])
    return f"; TorchCompile measured these regions slower compiled (eager/compiled time) and runs them eager: {shown}"


def _overhead_lever(row: ClassRoofline, report: RooflineReport, pct: float) -> str:
    per_call = 1e6 * row.seconds / max(row.calls, 1)
    options = []
    if not _compiled(report):
        options.append(_compile_call(report))
    if report.cuda:
        options.append("CUDA graphs (TorchCompile(mode='reduce-overhead'))")
    options.append("a bigger batch")
    return (f"overhead-bound: {row.calls / report.steps:.0f} calls / step of {per_call:.1f} us each, at {pct:.1f}%"
            f" of its roof: fewer, larger ops: " + ", ".join(options))


def layout_lever(row: ClassRoofline, report: RooflineReport) -> tuple[bool, str] | None:
    """``(actionable, words)`` about the class's memory layout, from this run's timing of both; ``None``: not timed.

    A layout is suggested only where it measured faster (by the same 5% bar as a precision): the one line that applies
    it converts the model's weights, and convolution follows its weight's layout (oneDNN and cuDNN both do).
    """
    fact = report.facts.layouts.get(row.op_class) if report.facts is not None else None
    if fact is None:
        return None
    if fact.current == "channels_last":
        if fact.ratio > FASTER:
            return True, (f"runs channels_last, but {fact.phrase()}:"
                          " model.to(memory_format=torch.contiguous_format) before fit")
        return False, f"runs channels_last ({fact.phrase()})"
    if fact.ratio * FASTER <= 1:
        return True, f"{fact.phrase()}: model.to(memory_format=torch.channels_last) before fit"
    return False, f"{fact.phrase()}: no layout lever here"


def lever(row: ClassRoofline, report: RooflineReport) -> str:
    """What to do about ``row``, with the measurement that supports it; no lever the measurement does not support.

    Args:
        row: one class of the window.
        report: the window (peaks, whether compiled, the model's blocks).
    """
    text = _lever(row, report)
    layout = layout_lever(row, report)
    return text if layout is None else f"{text}; {layout[1]}"


def _lever(row: ClassRoofline, report: RooflineReport) -> str:
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
        return _with_precision(_overhead_lever(row, report, pct), row, report)
    text = _gemm_lever(row, report, kind, pct) if row.op_class in GEMM_CLASSES else _elementwise_lever(
        row, report, kind, pct)
    if pct < 10:
        text += (f"; at only {pct:.1f}% of its roof in ops of {1e3 * row.seconds / row.calls:.2f} ms each, which is"
                 " not launch cost: slow kernels (see this class's ops in top_ops: strided or broadcast inputs, a"
                 " fallback path, first-touch page faults of fresh outputs on CPU)")
    return text


def _elementwise_lever(row: ClassRoofline, report: RooflineReport, kind: str, pct: float) -> str:
    peaks = report.peaks
    if kind == "memory" and not _compiled(report):
        return (f"memory-bound at {row.pct_bandwidth(peaks):.0f}% of the measured bandwidth"
                f" ({peaks.bandwidth_gbps:.1f} GB/s): fuse it with its neighbours: {_compile_call(report)}")
    if kind == "memory":
        return (f"memory-bound at {row.pct_bandwidth(peaks):.0f}% of the measured bandwidth, compiled already: fewer"
                " bytes (smaller activations) is what is left" + _eager_note(report))
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
