"""What a profiler window logs to TensorBoard: its scalars, its note and its tables (no Trainer here)."""

from __future__ import annotations

from typing import Any

from lightning_opkit.core.logging import LogWriter, markdown_table
from lightning_opkit.profiler.op_times import WindowReport
from lightning_opkit.profiler.roofline.report import RooflineReport
from lightning_opkit.profiler.roofline.view import log_roofline


def window_charts(roofline: bool) -> dict[str, dict[str, list[Any]]]:
    """ProfilerWindows' custom-scalar charts: the op classes', and the roofline's when it draws one."""
    charts = {"opkit profiler": {
        "op-class share of profiled self time (%)": ["Multiline", [r"opkit/profiler/[a-z]+/percent"]],
        "op-class self time (ms / step)": ["Multiline", [r"opkit/profiler/[a-z]+/self_ms"]],
        "step time (ms)": ["Multiline", [r"opkit/profiler/step_time_ms", r"opkit/profiler/framework_ms"]],
    }}
    if roofline:
        charts["opkit roofline"] = {
            "achieved TFLOP/s per op class": ["Multiline", [r"opkit/profiler/[a-z]+/tflops"]],
            "achieved GB/s per op class": ["Multiline", [r"opkit/profiler/[a-z]+/gbps"]],
            "% of the measured GEMM peak of its dtype": ["Multiline", [r"opkit/profiler/[a-z]+/pct_peak"]],
            "% of the measured copy bandwidth": ["Multiline", [r"opkit/profiler/[a-z]+/pct_bandwidth"]],
            "step MFU (%)": ["Multiline", [r"opkit/profiler/mfu", r"opkit/profiler/mfu_fp32",
                                           r"opkit/profiler/mfu_bf16"]],
        }
    return charts


def log_window(writer: LogWriter, report: WindowReport, step: int, *, window_no: int, partial: bool,
               export_s: float | None, with_flops: bool, top_k: int, charted: set[str],
               roofline: RooflineReport | None = None) -> None:
    """Log one window's scalars, ``top_ops`` and ``op_classes`` tables (and its roofline) at ``step``.

    Args:
        writer: the run's writer.
        report: the window's report.
        step: the global step the window ended at.
        window_no: the window's number in this run (1-based).
        partial: the window was cut short.
        export_s: seconds its trace export took (None when not exported).
        with_flops: the profiler counted FLOPs (logs ``gflops_per_s`` and a FLOPs column).
        top_k: rows in the top-ops table.
        charted: classes charted so far in this run; updated with the classes that ran.
        roofline: the window's roofline, when one was built.

    Example:
        >>> import lightning.pytorch as pl, tempfile
        >>> trainer = pl.Trainer(default_root_dir=tempfile.mkdtemp(), logger=False, enable_progress_bar=False)
        >>> writer, charted = LogWriter(trainer), set()
        >>> report = WindowReport(steps=2, step_time_ms=5.0, class_self_us={"matmul": 6000.0, "norm": 0.0})
        >>> log_window(writer, report, 10, window_no=1, partial=False, export_s=None, with_flops=False,
        ...            top_k=15, charted=charted)
        >>> charted
        {'matmul'}
        >>> writer.close()
    """
    seconds = report.step_time_ms * report.steps / 1e3
    peak = report.peak_memory_bytes
    writer.scalars("opkit/profiler", {
        "windows": window_no, "step_time_ms": report.step_time_ms, "profiled_steps": report.steps,
        "framework_ms": report.framework_self_us / 1e3 / report.steps,
        "peak_memory_mb": None if peak is None else peak / 2**20,
        "gflops_per_s": report.flops / seconds / 1e9 if with_flops and seconds > 0 else None,
        "export_s": export_s}, step)
    if report.communication_us:
        writer.scalars("opkit/profiler/communication", {
            "ms": report.communication_us / 1e3 / report.steps,
            "exposed_ms": report.exposed_communication_us / 1e3 / report.steps,
            "exposed_percent": 100 * report.exposed_communication_us / 1e3 / report.steps
            / max(report.step_time_ms, 1e-9)}, step)
    percent = report.class_percent()
    # A class is charted from the first window it ran in on (zeros after that keep its line whole); classes that
    # never ran are not charted at all.
    charted.update(cls for cls, us in report.class_self_us.items() if us > 0)
    for cls, us in report.class_self_us.items():
        if cls in charted:
            writer.scalars(f"opkit/profiler/{cls}", {"self_ms": us / 1e3 / report.steps, "percent": percent[cls]},
                           step)
    note = window_note(report, step, window_no, partial)
    writer.text("opkit/profiler/top_ops", note + "\n\n" + top_ops_table(report, top_k, with_flops), step)
    writer.text("opkit/profiler/op_classes", note + "\n\n" + class_table(report), step)
    if roofline is not None:
        log_roofline(writer, roofline, note, f"Window {window_no} (step {step})", step)
    writer.flush()


def window_note(report: WindowReport, step: int, window_no: int, partial: bool) -> str:
    """The line above a window's tables: its steps, whether it was cut short, and the overhead left out."""
    overhead = report.framework_self_us / (1e3 * report.steps)
    return (f"Window {window_no}: steps {step - report.steps + 1}-{step} ({report.steps} step(s)"
            + (", cut short)" if partial else ")") + f"; framework / Python overhead (profiler step, optimizer"
            f" step, data loading, compiled code's Python, compilation) {overhead:.3f} ms / step, not in the shares")


def top_ops_table(report: WindowReport, top_k: int, with_flops: bool) -> str:
    """The window's ``top_k`` ops by self time, per step, with their class (and GFLOPs)."""
    total = report.total_self_us or 1.0
    per_step = 1e3 * report.steps
    headers = ["op", "class", "calls / step", "self ms / step", "total ms / step", "% self"] + (
        ["GFLOP / step"] if with_flops else [])
    rows = [[r.name, r.op_class, r.calls / report.steps, r.self_us / per_step, r.total_us / per_step,
             100 * r.self_us / total] + ([r.flops / 1e9 / report.steps] if with_flops else [])
            for r in report.ops[:top_k]]
    return markdown_table(headers, rows)


def class_table(report: WindowReport) -> str:
    """Self time per op class (and per compiled region), per step, largest first; classes that did not run left out.

    Example:
        >>> print(class_table(WindowReport(steps=2, step_time_ms=5.0, class_self_us={"matmul": 6e3, "norm": 2e3,
        ...                                                                           "loss": 0.0})))
        | class | self ms / step | % self |
        |---|---|---|
        | matmul | 3.000 | 75.000 |
        | norm | 1.000 | 25.000 |
    """
    percent = report.class_percent()
    per_step = 1e3 * report.steps
    rows = [[cls, us / per_step, percent[cls]] for cls, us in
            sorted(report.class_self_us.items(), key=lambda kv: -kv[1]) if us > 0]
    text = markdown_table(["class", "self ms / step", "% self"], rows)
    if report.region_total_us:
        text += "\n\n**Compiled regions** (TorchCompile), total ms / step:\n\n" + markdown_table(
            ["region", "total ms / step"], sorted(([name, us / per_step] for name, us in
                                                   report.region_total_us.items()), key=lambda r: -r[1]))
    return text


def traces_line(files: list[str], folder: str) -> str:
    """The summary's word on trace files: how many and where, or why none (no logger and no ``log_dir``).

    Example:
        >>> traces_line(["a", "b"], "logs/traces"), traces_line([], "")
        ('2 trace file(s) in logs/traces', 'no trace files (the Trainer has no logger; log_dir= keeps them)')
    """
    return f"{len(files)} trace file(s) in {folder}" if folder else \
        "no trace files (the Trainer has no logger; log_dir= keeps them)"
