"""One run summary for all opkit callbacks of a Trainer, and one TensorBoard custom-scalars layout.

Each callback contributes lines (``summary_lines()``); the first opkit callback in ``trainer.callbacks`` prints the
summary on rank zero when fit ends or fails, writes it as the text tag ``opkit/summary``, and at setup writes the
custom-scalars layout that groups every area's charts.
"""

from __future__ import annotations

import shlex
from typing import Any

import lightning.pytorch as pl

from lightning_opkit.core.logging import TensorBoardWriter

#: TensorBoard's Custom Scalars tab: one multiline chart per question, tags as regular expressions.
LAYOUT: dict[str, dict[str, list[Any]]] = {
    "opkit profiler": {
        "op-class share of profiled self time (%)": ["Multiline", [r"opkit/profiler/[a-z]+/percent"]],
        "op-class self time (ms / step)": ["Multiline", [r"opkit/profiler/[a-z]+/self_ms"]],
        "step time (ms)": ["Multiline", [r"opkit/profiler/step_time_ms", r"opkit/compile/step_time_ms",
                                         r"opkit/profiler/framework_ms"]],
    },
    "opkit roofline": {
        "achieved TFLOP/s per op class": ["Multiline", [r"opkit/profiler/[a-z]+/tflops"]],
        "achieved GB/s per op class": ["Multiline", [r"opkit/profiler/[a-z]+/gbps"]],
        "% of the measured GEMM peak of its dtype": ["Multiline", [r"opkit/profiler/[a-z]+/pct_peak"]],
        "% of the measured copy bandwidth": ["Multiline", [r"opkit/profiler/[a-z]+/pct_bandwidth"]],
        "step MFU (%)": ["Multiline", [r"opkit/profiler/mfu", r"opkit/profiler/mfu_fp32", r"opkit/profiler/mfu_bf16"]],
    },
    "opkit precision": {
        "16-bit output error vs fp32 recompute (relative)": ["Multiline", [r"opkit/precision/[a-z]+/rel_error"]],
        "16-bit outputs lost to underflow (fraction)": ["Multiline", [r"opkit/precision/[a-z]+/underflow_frac"]],
        "fp16 headroom to overflow (bits)": ["Multiline", [r"opkit/precision/[a-z]+/headroom_bits"]],
        "calls per census step": ["Multiline", [r"opkit/precision/[a-z]+/calls"]],
        "measurement time (s)": ["Multiline", [r"opkit/precision/measure_s"]],
    },
    "opkit nan": {
        "non-finite events and skipped steps": ["Multiline", [r"opkit/nan/events", r"opkit/nan/skipped_steps",
                                                              r"opkit/nan/consecutive_skips"]],
    },
    "opkit compile": {
        "compiles, graphs, breaks, recompiles": ["Multiline", [r"opkit/compile/compiles", r"opkit/compile/graphs",
                                                               r"opkit/compile/graph_breaks",
                                                               r"opkit/compile/recompiles"]],
        "compile time (s)": ["Multiline", [r"opkit/compile/compile_time_s"]],
    },
}


def _opkit_callbacks(trainer: pl.Trainer) -> list[Any]:
    return [c for c in trainer.callbacks if hasattr(c, "summary_lines")]  # type: ignore[attr-defined]


def is_first(trainer: pl.Trainer, callback: Any) -> bool:
    """Whether ``callback`` is the first opkit callback of ``trainer`` (the one that writes shared things)."""
    first = _opkit_callbacks(trainer)
    return bool(first) and first[0] is callback


def write_layout(trainer: pl.Trainer, callback: Any, writer: TensorBoardWriter) -> None:
    """Write the custom-scalars layout once per run (by the first opkit callback, on rank zero).

    Args:
        trainer: the running trainer.
        callback: the calling opkit callback.
        writer: its writer.
    """
    if is_first(trainer, callback) and writer.active:
        # the roofline's charts only where a ProfilerWindows draws one: empty charts are clutter
        roofline = any(getattr(c, "roofline", False) is True for c in _opkit_callbacks(trainer))
        writer.custom_scalars({k: v for k, v in LAYOUT.items() if roofline or k != "opkit roofline"})


def start_summary(callback: Any, trainer: pl.Trainer, writer: TensorBoardWriter) -> None:
    """At a fit's setup: arm the summary and write the layout (first opkit callback only).

    Args:
        callback: the calling opkit callback.
        trainer: the running trainer.
        writer: its writer.
    """
    callback._opkit_summarized = False
    write_layout(trainer, callback, writer)


def end_summary(callback: Any, trainer: pl.Trainer, writer: TensorBoardWriter | None,
              exception: BaseException | None = None) -> None:
    """At the end of a fit or on its exception: the summary, once (first opkit callback only).

    Args:
        callback: the calling opkit callback.
        trainer: the trainer.
        writer: its writer.
        exception: what ended the fit, if it failed.
    """
    if getattr(callback, "_opkit_summarized", True):
        return
    callback._opkit_summarized = True
    report(trainer, callback, writer, exception)


def report(trainer: pl.Trainer, callback: Any, writer: TensorBoardWriter | None,
           exception: BaseException | None = None) -> str | None:
    """Print the run summary and write it as ``opkit/summary`` (first opkit callback, rank zero, fit only).

    Args:
        trainer: the trainer whose fit ended.
        callback: the calling opkit callback.
        writer: its writer (``None``: no summary, the callback was never set up for a fit).
        exception: what ended the fit, if it failed.

    Returns:
        The summary text, or ``None`` when this callback does not write it.
    """
    if not is_first(trainer, callback) or not trainer.is_global_zero or writer is None:
        return None
    log_dir = writer.run_dir  # not run_log_dir(trainer) here: under DDP that is a collective, and this is rank zero
    ended = f"ended by {type(exception).__name__}: {exception}" if exception else "fit finished"
    lines = [f"opkit run summary ({ended}, global step {trainer.global_step})",
             f"  logs and traces: {log_dir}",
             f"  open them with:  tensorboard --logdir {shlex.quote(log_dir)}"]
    for cb in _opkit_callbacks(trainer):
        lines += [f"  {line}" for line in cb.summary_lines()]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    writer.text("opkit/summary", "\n".join(f"    {line}" for line in lines), trainer.global_step)
    writer.flush()
    return text
