"""ProfilerWindows: short torch.profiler windows every N training steps, broken down by operator class."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opkit._checks import check_bools, check_int
from lightning_opkit._profile_report import WindowReport, peak_cpu_memory, summarize
from lightning_opkit._summary import end_summary, start_summary
from lightning_opkit._tensorboard import TensorBoardWriter, markdown_table, run_log_dir

__all__ = ["ProfilerWindows", "window_phase"]


def window_phase(batch: int, every_n_steps: int, warmup: int, active: int) -> tuple[int, str]:
    """Where training batch ``batch`` (0-based) falls in the window schedule: ``(window index, phase)``.

    Windows open at batches ``every_n_steps``, ``2 * every_n_steps``, ... (the first ``every_n_steps`` batches,
    with their start-up costs, are never profiled); each runs ``warmup`` unrecorded then ``active`` recorded batches.
    Phases are ``"warmup"``, ``"active"`` or ``"idle"``; the index counts from 0 and is -1 before the first window.

    Args:
        batch: the training batch index, counted over the whole run.
        every_n_steps: distance between window starts.
        warmup: batches run under the profiler but not recorded.
        active: recorded batches.

    Example:
        >>> [window_phase(b, 4, 1, 2)[1] for b in range(4, 9)]
        ['warmup', 'active', 'active', 'idle', 'warmup']
    """
    index, offset = divmod(batch, every_n_steps)
    if index == 0:
        return -1, "idle"
    if offset < warmup:
        return index - 1, "warmup"
    if offset < warmup + active:
        return index - 1, "active"
    return index - 1, "idle"


@dataclass
class _Window:
    prof: Any
    step_times: list[float] = field(default_factory=list)
    batch_t0: float | None = None
    ready: bool = False


class ProfilerWindows(Callback):
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
    ) -> None:
        for name, value, low in (("every_n_steps", every_n_steps, 1), ("warmup", warmup, 0), ("active", active, 1),
                                 ("top_k", top_k, 1), ("keep_traces", keep_traces, 0)):
            check_int(name, value, low)
        check_bools(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                    with_flops=with_flops, export_trace=export_trace, gzip=gzip, all_ranks=all_ranks,
                    span_validation=span_validation)
        if warmup + active > every_n_steps:
            raise ValueError(
                f"A window of `warmup` + `active` = {warmup} + {active} steps does not fit in `every_n_steps`="
                f"{every_n_steps}: windows would overlap. Use warmup + active <= every_n_steps."
            )
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

        self.windows_done = 0
        self.batches_seen = 0
        #: trace exports that failed in this run (unwritable log dir, full disk): warned, logged, training went on
        self.export_errors = 0
        #: paths of the traces written by this run, oldest first
        self.trace_files: list[str] = []
        #: the last window's report
        self.last_report: WindowReport | None = None
        self._window: _Window | None = None
        self._writer: TensorBoardWriter | None = None
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
        self._writer = TensorBoardWriter(trainer)
        if stage == "fit":
            start_summary(self, trainer, self._writer)
        self._trace_dir = os.path.join(run_log_dir(trainer), "traces")
        self._enabled = self.all_ranks or trainer.is_global_zero

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close(trainer, partial=True)
        if stage == "fit":
            end_summary(self, trainer, self._writer)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close(trainer, partial=True)
        end_summary(self, trainer, self._writer, exception)
        self.teardown(trainer, pl_module, "exception")

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        line = f"profiler: {self.windows_done} window(s), {len(self.trace_files)} trace file(s) in {self._trace_dir}"
        report = self.last_report
        if report is None:
            return [line]
        top = sorted(report.class_percent().items(), key=lambda kv: -kv[1])[:3]
        return [line, "  last window's top op classes: " + ", ".join(f"{c} {p:.1f}%" for c, p in top)
                + f" ({report.step_time_ms:.2f} ms / step)"]

    # the schedule

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        batch_no = self.batches_seen
        self.batches_seen += 1
        if not self._enabled:
            return
        _, phase = window_phase(batch_no, self.every_n_steps, self.warmup, self.active)
        if self._window is None and batch_no > 0 and batch_no % self.every_n_steps == 0:
            self._open()
        window = self._window
        if window is not None and phase == "active":
            _sync()
            window.batch_t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        window = self._window
        if window is None:
            return
        if window.batch_t0 is not None:
            _sync()
            window.step_times.append(time.perf_counter() - window.batch_t0)
            window.batch_t0 = None
        with warnings.catch_warnings(), _quiet_stderr():  # the last step of a window stops the profiler
            warnings.simplefilter("ignore")
            window.prof.step()
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

    def _open(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.reset_peak_memory_stats()
        window = _Window(None)

        def ready(_: Any) -> None:
            window.ready = True

        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")  # "won't be using warmup" for warmup=0 is what the user asked for
            window.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=self.warmup, active=self.active, repeat=1),
                on_trace_ready=ready,
                record_shapes=self.record_shapes,
                profile_memory=self.profile_memory,
                with_stack=self.with_stack,
                with_flops=self.with_flops,
            )
            window.prof.start()
        self._window = window

    def _close(self, trainer: pl.Trainer, partial: bool) -> None:
        window, self._window = self._window, None
        if window is None:
            return
        with warnings.catch_warnings(), _quiet_stderr():
            warnings.simplefilter("ignore")  # a cut window is "RECORD followed by NONE" to torch
            window.prof.stop()
        try:
            if window.step_times:
                self._report(trainer, window, partial)
        finally:
            # A finished profile sits in reference cycles (its action map holds its own bound methods) with all its
            # events until a full garbage collection: about 2 MB a window. Emptying it frees them now.
            vars(window.prof).clear()
            window.prof = None

    def _report(self, trainer: pl.Trainer, window: _Window, partial: bool) -> None:
        cuda = torch.profiler.ProfilerActivity.CUDA in (window.prof.activities or [])
        report = summarize(window.prof, window.step_times, use_device=cuda)
        if self.profile_memory:
            report.peak_memory_bytes = float(torch.cuda.max_memory_allocated()) if cuda else peak_cpu_memory(
                window.prof)
        self.windows_done += 1
        self.last_report = report
        step = trainer.global_step
        export_s = None
        if self.export_trace:
            try:
                export_s = self._export(trainer, window, step)
            except Exception as err:  # a trace is not worth the run: unwritable dir, full disk, ...
                self.export_errors += 1
                warnings.warn(f"ProfilerWindows: could not write the trace of the window at step {step} to"
                              f" {self._trace_dir!r} ({type(err).__name__}: {err}); training goes on.", stacklevel=2)
                if self._writer is not None:
                    self._writer.scalar("opkit/profiler/export_errors", self.export_errors, step)
        self._log(report, step, export_s, partial)

    def _export(self, trainer: pl.Trainer, window: _Window, step: int) -> float:
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

    def _log(self, report: WindowReport, step: int, export_s: float | None, partial: bool) -> None:
        writer = self._writer
        if writer is None or not writer.active:
            return
        writer.scalar("opkit/profiler/windows", self.windows_done, step)
        writer.scalar("opkit/profiler/step_time_ms", report.step_time_ms, step)
        writer.scalar("opkit/profiler/profiled_steps", report.steps, step)
        percent = report.class_percent()
        # A class is charted from the first window it ran in on (zeros after that keep its line whole); classes that
        # never ran are not charted at all.
        self._charted.update(cls for cls, us in report.class_self_us.items() if us > 0)
        for cls, us in report.class_self_us.items():
            if cls in self._charted:
                writer.scalar(f"opkit/profiler/{cls}/self_ms", us / 1e3 / report.steps, step)
                writer.scalar(f"opkit/profiler/{cls}/percent", percent[cls], step)
        writer.scalar("opkit/profiler/framework_ms", report.framework_self_us / 1e3 / report.steps, step)
        if report.peak_memory_bytes is not None:
            writer.scalar("opkit/profiler/peak_memory_mb", report.peak_memory_bytes / 2**20, step)
        seconds = report.step_time_ms * report.steps / 1e3
        if self.with_flops and seconds > 0:
            writer.scalar("opkit/profiler/gflops_per_s", report.flops / seconds / 1e9, step)
        if export_s is not None:
            writer.scalar("opkit/profiler/export_s", export_s, step)
        total = report.total_self_us or 1.0
        per_step = 1e3 * report.steps
        headers = ["op", "class", "calls / step", "self ms / step", "total ms / step", "% self"] + (
            ["GFLOP / step"] if self.with_flops else [])
        rows = [[r.name, r.op_class, r.calls / report.steps, r.self_us / per_step, r.total_us / per_step,
                 100 * r.self_us / total] + ([r.flops / 1e9 / report.steps] if self.with_flops else [])
                for r in report.ops[: self.top_k]]
        first = step - report.steps + 1
        overhead = report.framework_self_us / per_step
        note = (f"Window {self.windows_done}: steps {first}-{step} ({report.steps} step(s)"
                + (", cut short)" if partial else ")") + f"; framework / Python overhead (profiler step, optimizer"
                f" step, data loading, compiled code's Python, compilation) {overhead:.3f} ms / step, not in the"
                " shares")
        writer.text("opkit/profiler/top_ops", note + "\n\n" + markdown_table(headers, rows), step)
        class_rows = [[cls, us / 1e3 / report.steps, percent[cls]] for cls, us in
                      sorted(report.class_self_us.items(), key=lambda kv: -kv[1]) if us > 0]
        regions = ""
        if report.region_total_us:
            regions = "\n\n**Compiled regions** (TorchCompile), total ms / step:\n\n" + markdown_table(
                ["region", "total ms / step"], sorted(([name, us / per_step] for name, us in
                                                       report.region_total_us.items()), key=lambda r: -r[1]))
        writer.text("opkit/profiler/op_classes", note + "\n\n" + markdown_table(
            ["class", "self ms / step", "% self"], class_rows) + regions, step)
        writer.flush()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    # Kineto writes "USDT ... profiler_start/stop" lines straight to file descriptor 2 at each window's start and
    # stop, through the progress bar; nothing else is written there in between.
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable stderr: nothing to keep quiet
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
