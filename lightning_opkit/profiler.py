"""ProfilerWindows: short torch.profiler windows every N training steps, broken down by operator class.

Logged (rank zero), per window at its last step: ``opkit/profiler/windows``, ``step_time_ms``, ``profiled_steps``,
``framework_ms``, ``<class>/self_ms`` and ``<class>/percent`` for every class that ran, ``peak_memory_mb``
(``profile_memory``), ``gflops_per_s`` (``with_flops``), ``export_s`` and ``export_errors`` (scalars), and the
``top_ops`` and ``op_classes`` tables (text). With ``roofline``: ``<class>/tflops``, ``gbps``, ``pct_peak``,
``pct_bandwidth``, ``intensity``, ``mfu`` (and ``mfu_fp32``, ``mfu_bf16``, ``model_tflops``), the ``roofline`` table
(text) and the ``roofline_plot`` image. Traces go to ``<log dir>/traces/rank<r>.<step>.pt.trace.json.gz``.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_opkit._base import OpkitCallback
from lightning_opkit._checks import check_bools, check_int
from lightning_opkit._peaks import measure_link
from lightning_opkit._profile_report import WindowReport, peak_cpu_memory, summarize
from lightning_opkit._profile_window import Window, opens_window, window_phase
from lightning_opkit._regions import find_blocks
from lightning_opkit._roofline_view import RooflineReport, build_report, log_roofline
from lightning_opkit._roofline_view import summary_lines as roofline_summary
from lightning_opkit._tensorboard import markdown_table, run_log_dir

__all__ = ["ProfilerWindows", "window_phase"]


def _check_schedule(every_n_steps: int, warmup: int, active: int) -> None:
    if warmup + active > every_n_steps:
        raise ValueError(
            f"A window of `warmup` + `active` = {warmup} + {active} steps does not fit in `every_n_steps`="
            f"{every_n_steps}: windows would overlap. Use warmup + active <= every_n_steps."
        )


class ProfilerWindows(OpkitCallback):
    """Open a short torch.profiler window every ``every_n_steps`` training steps; nothing runs between windows.

    Each window runs ``warmup`` steps under the profiler unrecorded and ``active`` steps recorded, then the profiler
    is stopped and released. Per window: a gzipped Chrome/Perfetto trace under ``<log dir>/traces`` (named
    ``rank<r>.<global step>.pt.trace.json.gz``, the layout TensorBoard's profiler plugin reads), and in TensorBoard
    the mean step time, self time per operator class (ms per step and % of profiled self time), a top-``top_k`` op
    table, peak memory (``profile_memory``) and achieved FLOP/s (``with_flops``). A window cut short by validation,
    an epoch end, ``max_steps`` or an exception is closed and reported if it recorded a step, else dropped.

    Args:
        every_n_steps: training batches between window starts; the first window opens at this batch.
        warmup: steps per window run under the profiler but not recorded.
        active: recorded steps per window.
        record_shapes: passed to ``torch.profiler.profile``.
        profile_memory: passed through; also logs the window's peak memory.
        with_stack: passed through.
        with_flops: passed through; also logs achieved FLOP/s and FLOPs per op.
        export_trace: write the window's trace file.
        top_k: rows in the top-ops table.
        gzip: write ``.json.gz`` traces (Perfetto and chrome://tracing open them).
        keep_traces: keep only this many newest trace files of this run (0 = keep all).
        all_ranks: under DDP, profile every rank into its own trace files (default: rank zero only).
        span_validation: let a window stay open across a validation loop (default: validation closes it).
        roofline: per window, each op class's achieved TFLOP/s and GB/s against this device's peaks (measured once
            per process: dense GEMMs per dtype that ran, a large copy, an all_reduce under DDP), what bounds it and
            the lever, the step's MFU; a table, a picture and scalars. Turns on ``record_shapes`` and ``with_flops``.

    Example:
        >>> windows = ProfilerWindows(every_n_steps=200, active=3)
        >>> trainer = pl.Trainer(callbacks=[windows], logger=False)
        >>> window_phase(201, windows.every_n_steps, windows.warmup, windows.active)
        (0, 'active')
    """

    def __init__(
        self,
        every_n_steps: int = 500,
        warmup: int = 1,
        active: int = 3,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        with_flops: bool = False,
        export_trace: bool = True,
        top_k: int = 15,
        gzip: bool = True,
        keep_traces: int = 0,
        all_ranks: bool = False,
        span_validation: bool = False,
        roofline: bool = False,
    ) -> None:
        super().__init__()
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("warmup", warmup, 0), ("active", active, 1),
                                 ("top_k", top_k, 1), ("keep_traces", keep_traces, 0)):
            check_int(name, value, low)
        check_bools(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                    with_flops=with_flops, export_trace=export_trace, gzip=gzip, all_ranks=all_ranks,
                    span_validation=span_validation, roofline=roofline)
        # the roofline reads each op's shapes, dtypes and the profiler's GEMM FLOPs
        self._profile_options = dict(record_shapes=record_shapes or roofline, profile_memory=profile_memory,
                                     with_stack=with_stack, with_flops=with_flops or roofline)
        _check_schedule(every_n_steps, warmup, active)
        self.every_n_steps = every_n_steps
        self.warmup = warmup
        self.active = active
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.with_flops = with_flops
        self.export_trace = export_trace
        self.top_k = top_k
        self.gzip = gzip
        self.keep_traces = keep_traces
        self.all_ranks = all_ranks
        self.span_validation = span_validation
        self.roofline = roofline

        self.windows_done = 0
        self.batches_seen = 0
        #: trace exports that failed in this run (unwritable log dir, full disk): warned, logged, training went on
        self.export_errors = 0
        #: paths of the traces written by this run, oldest first
        self.trace_files: list[str] = []
        #: the last window's report
        self.last_report: WindowReport | None = None
        #: the last window's roofline (``roofline=True``)
        self.last_roofline: RooflineReport | None = None
        self._link_gbps: float | None = None
        self._roofline_off = False  # set when measuring failed in this fit
        self._blocks: list[str] = []
        self._window: Window | None = None
        self._trace_dir = ""
        self._charted: set[str] = set()
        self._enabled = True

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(every_n_steps=self.every_n_steps, warmup=self.warmup, active=self.active)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"windows_done": self.windows_done, "batches_seen": self.batches_seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.windows_done = int(state_dict.get("windows_done", 0))
        self.batches_seen = int(state_dict.get("batches_seen", 0))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(trainer, partial=True)
        if stage == "fit":
            # A new fit starts its schedule afresh (a checkpoint, loaded after setup, resumes it), and never deletes
            # another run's traces through keep_traces.
            self.windows_done = self.batches_seen = self.export_errors = 0
            self.trace_files = []
            self._charted = set()
        self._open_writer(trainer, stage)
        self._trace_dir = os.path.join(run_log_dir(trainer), "traces")
        self._enabled = self.all_ranks or trainer.is_global_zero
        if self.roofline and stage == "fit":
            self._roofline_off = False
            self._blocks = find_blocks(pl_module)
            self._link_gbps = measure_link(trainer.strategy.root_device)  # a collective: every rank, here

    @override
    def _wind_down(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer, partial=True)

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        line = f"profiler: {self.windows_done} window(s), {len(self.trace_files)} trace file(s) in {self._trace_dir}"
        report = self.last_report
        if report is None:
            return [line]
        top = sorted(report.class_percent().items(), key=lambda kv: -kv[1])[:3]
        lines = [line, "  last window's top op classes: " + ", ".join(f"{c} {p:.1f}%" for c, p in top)
                 + f" ({report.step_time_ms:.2f} ms / step)"]
        return lines + (roofline_summary(self.last_roofline) if self.last_roofline is not None else [])

    # the schedule: window_phase

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        batch_no = self.batches_seen
        self.batches_seen += 1
        if not self._enabled:
            return
        if self._window is None and opens_window(batch_no, self.every_n_steps):
            self._window = Window(self.every_n_steps, self.warmup, self.active, self._profile_options)
        if self._window is not None:
            self._window.begin_batch(window_phase(batch_no, self.every_n_steps, self.warmup, self.active)[1])

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        window = self._window
        if window is None:
            return
        window.end_batch()
        if window.ready:
            self._close(trainer, partial=False)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.span_validation and trainer.state.fn == "fit":
            self._close(trainer, partial=True)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.span_validation:
            self._close(trainer, partial=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer, partial=True)

    def _close(self, trainer: pl.Trainer, partial: bool) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        window.stop()
        try:
            if window.step_times:
                self._report(trainer, window, partial)
        finally:
            window.release()

    def _report(self, trainer: pl.Trainer, window: Window, partial: bool) -> None:
        report = summarize(window.prof, window.step_times, use_device=window.uses_cuda)
        if self.profile_memory:
            report.peak_memory_bytes = (float(torch.cuda.max_memory_allocated()) if window.uses_cuda
                                        else peak_cpu_memory(window.prof))
        self.windows_done += 1
        self.last_report = report
        if self.roofline and not self._roofline_off:
            self._roofline_report(trainer, window, report)
        step = trainer.global_step
        export_s = None
        if self.export_trace:
            try:
                export_s = self._export(trainer, window, step)
            except Exception as err:  # a trace is not worth the run: unwritable dir, full disk, ...
                self.export_errors += 1
                warnings.warn(f"ProfilerWindows: could not write the trace of the window at step {step} to"
                              f" {self._trace_dir!r} ({type(err).__name__}: {err}); training goes on.", stacklevel=2)
                self._scalars("opkit/profiler", {"export_errors": self.export_errors}, step)
        self._log(report, step, export_s, partial)

    def _roofline_report(self, trainer: pl.Trainer, window: Window, report: WindowReport) -> None:
        try:
            self.last_roofline = build_report(
                window.prof, report.steps, report.step_time_ms / 1e3, device=trainer.strategy.root_device,
                communication_seconds=report.communication_us / 1e6,
                exposed_communication_seconds=report.exposed_communication_us / 1e6, link_gbps=self._link_gbps,
                blocks=self._blocks, cuda=window.uses_cuda)
        except Exception as err:  # measuring the peaks can run out of memory beside the model: not worth the run
            self._roofline_off = True
            self.last_roofline = None
            warnings.warn(f"ProfilerWindows: the roofline failed ({type(err).__name__}: {err}); it is off for the"
                          " rest of this run, the windows go on.", stacklevel=2)

    def _export(self, trainer: pl.Trainer, window: Window, step: int) -> float:
        os.makedirs(self._trace_dir, exist_ok=True)
        path = os.path.join(self._trace_dir, f"rank{trainer.global_rank}.{step}.pt.trace.json" +
                            (".gz" if self.gzip else ""))
        t0 = time.perf_counter()
        window.prof.export_chrome_trace(path)
        elapsed = time.perf_counter() - t0
        self.trace_files.append(path)
        while self.keep_traces and len(self.trace_files) > self.keep_traces:
            old = self.trace_files.pop(0)
            if os.path.exists(old):
                os.remove(old)
        return elapsed

    # what gets logged where

    def _log(self, report: WindowReport, step: int, export_s: float | None, partial: bool) -> None:
        writer = self._writer
        if writer is None or not writer.active:
            return
        seconds = report.step_time_ms * report.steps / 1e3
        peak = report.peak_memory_bytes
        writer.scalars("opkit/profiler", {
            "windows": self.windows_done, "step_time_ms": report.step_time_ms, "profiled_steps": report.steps,
            "framework_ms": report.framework_self_us / 1e3 / report.steps,
            "peak_memory_mb": None if peak is None else peak / 2**20,
            "gflops_per_s": report.flops / seconds / 1e9 if self.with_flops and seconds > 0 else None,
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
        self._charted.update(cls for cls, us in report.class_self_us.items() if us > 0)
        for cls, us in report.class_self_us.items():
            if cls in self._charted:
                writer.scalars(f"opkit/profiler/{cls}", {"self_ms": us / 1e3 / report.steps,
                                                         "percent": percent[cls]}, step)
        note = self._window_note(report, step, partial)
        writer.text("opkit/profiler/top_ops", note + "\n\n" + self._top_ops_table(report), step)
        writer.text("opkit/profiler/op_classes", note + "\n\n" + _class_table(report), step)
        if self.roofline and self.last_roofline is not None:
            title = f"Window {self.windows_done} (step {step})"
            log_roofline(writer, self.last_roofline, note, title, step)
        writer.flush()

    def _window_note(self, report: WindowReport, step: int, partial: bool) -> str:
        overhead = report.framework_self_us / (1e3 * report.steps)
        return (f"Window {self.windows_done}: steps {step - report.steps + 1}-{step} ({report.steps} step(s)"
                + (", cut short)" if partial else ")") + f"; framework / Python overhead (profiler step, optimizer"
                f" step, data loading, compiled code's Python, compilation) {overhead:.3f} ms / step, not in the"
                " shares")

    def _top_ops_table(self, report: WindowReport) -> str:
        total = report.total_self_us or 1.0
        per_step = 1e3 * report.steps
        headers = ["op", "class", "calls / step", "self ms / step", "total ms / step", "% self"] + (
            ["GFLOP / step"] if self.with_flops else [])
        rows = [[r.name, r.op_class, r.calls / report.steps, r.self_us / per_step, r.total_us / per_step,
                 100 * r.self_us / total] + ([r.flops / 1e9 / report.steps] if self.with_flops else [])
                for r in report.ops[: self.top_k]]
        return markdown_table(headers, rows)


def _class_table(report: WindowReport) -> str:
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
