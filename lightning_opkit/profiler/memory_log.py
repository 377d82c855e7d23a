"""What the memory view logs: scalars, the modules and op-class tables, the stacked bars per block (no Trainer)."""

from __future__ import annotations

from matplotlib.figure import Figure

from lightning_opkit.core.logging import LogWriter, markdown_table
from lightning_opkit.profiler.memory import MemoryReport

__all__ = ["blocks_figure", "log_memory", "memory_summary", "out_of_memory_lines"]

_MB = 2**20
_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan", "navy", "gold", "teal", "maroon", "lime", "black")


def blocks_figure(report: MemoryReport, title: str) -> Figure:
    """Stacked bars: per block, the activation bytes it saves for backward, by the op class that produced them.

    Args:
        report: the window's memory.
        title: the figure's title.

    Example:
        >>> report = MemoryReport(0, 0, 0, 3 * 2**20, by_block_class={"h.0": {"matmul": 2**21, "norm": 2**20}})
        >>> [t.get_text() for t in blocks_figure(report, "window 1").axes[0].get_legend().get_texts()]
        ['matmul', 'norm']
    """
    figure = Figure(figsize=(9.0, 4.8), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    axes.set_title(title, fontsize=10, loc="left")
    blocks = list(report.by_block_class)
    if not blocks:
        axes.set_axis_off()
        axes.text(0.5, 0.5, "no repeated blocks found in this model", ha="center", va="center")
        return figure
    totals: dict[str, int] = {}
    for cells in report.by_block_class.values():
        for cls, n in cells.items():
            totals[cls] = totals.get(cls, 0) + n
    bottom = [0.0] * len(blocks)
    for i, cls in enumerate(sorted(totals, key=lambda c: -totals[c])):
        heights = [report.by_block_class[b].get(cls, 0) / _MB for b in blocks]
        axes.bar(range(len(blocks)), heights, bottom=bottom, label=cls, color=_COLORS[i % len(_COLORS)])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    axes.set_xticks(range(len(blocks)), blocks, rotation=45 if len(blocks) > 6 else 0, ha="right", fontsize=8)
    axes.set_ylabel("activations saved for backward (MB)")
    axes.legend(title="produced by", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


def log_memory(writer: LogWriter, report: MemoryReport, step: int, top_k: int, window_no: int) -> None:
    """Log one window's memory: ``opkit/memory/*`` scalars, the ``modules`` and ``op_classes`` tables, the picture.

    Args:
        writer: the run's writer.
        report: the window's memory.
        step: the global step the window ended at.
        top_k: module rows besides the blocks.
        window_no: the window's number in this run.
    """
    writer.scalars("opkit/memory", report.scalars(), step)
    lever = report.lever()
    kinds = [["parameters", f"{report.parameters / _MB:.2f}"], ["gradients", f"{report.gradients / _MB:.2f}"],
             ["optimizer state", f"{report.optimizer / _MB:.2f}"],
             ["activations saved for backward", f"{report.activations / _MB:.2f}"],
             ["peak", "-" if report.peak is None else f"{report.peak / _MB:.2f}"]]
    writer.text("opkit/memory/modules", markdown_table(["kind", "MB"], kinds) + "\n\n" + markdown_table(
        ["module", "activations MB", "share", "forward ms"], report.module_rows(top_k))
        + (f"\n\n**lever**: {lever}" if lever else ""), step)
    writer.table("opkit/memory/op_classes", ["produced by", "activations MB", "share"], report.class_rows(), step)
    figure = blocks_figure(report, f"window {window_no}, step {report.step}: activations per block")
    try:
        writer.figure("opkit/memory/blocks", figure, step)
    finally:
        figure.clear()
    writer.flush()


def memory_summary(report: MemoryReport) -> list[str]:
    """The run summary's memory lines (also printed when the run ends by an exception, out of memory included)."""
    peak = "-" if report.peak is None else f"{report.peak / _MB:.1f}"
    lines = [f"  memory (step {report.step}): parameters {report.parameters / _MB:.1f} MB, gradients"
             f" {report.gradients / _MB:.1f}, optimizer {report.optimizer / _MB:.1f}, activations"
             f" {report.activations / _MB:.1f}, peak {peak}" + (
                 " (probed eagerly: a compiled region holds the blocks, and the probe's hooks would recompile it)"
                 if report.eager else "")]
    rows = report.module_rows(3)
    if rows:
        lines.append("  activations by module: " + ", ".join(f"{r[0]} {r[1]} MB" for r in rows[:6]))
    lever = report.lever()
    if lever:
        lines.append(f"  lever: {lever}")
    return lines


def out_of_memory_lines(report: MemoryReport | None, memory: bool, snapshot: str | None) -> list[str]:
    """What the run summary adds when the fit ran out of memory: where to look next.

    Example:
        >>> "ProfilerWindows(memory_breakdown=True)" in out_of_memory_lines(None, False, None)[0]
        True
    """
    if report is not None:
        lines = [f"  out of memory: the memory lines above are the last window's (step {report.step})"]
    elif memory:
        lines = ["  out of memory before the first memory window: windows sooner (every_n_steps) show where it goes"]
    else:
        lines = ["  out of memory: ProfilerWindows(memory_breakdown=True) shows which blocks hold the activations and"
                 " what checkpointing them would free"]
    if snapshot is not None:
        lines.append(f"  memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz)")
    return lines
