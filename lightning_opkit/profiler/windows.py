"""ProfilerWindows: short torch.profiler windows every N training steps, broken down by operator class.

Logged (rank zero), per window at its last step: ``opkit/profiler/windows``, ``step_time_ms``, ``profiled_steps``,
``framework_ms``, ``<class>/self_ms`` and ``<class>/percent`` for every class that ran, ``peak_memory_mb``
(``profile_memory``), ``gflops_per_s`` (``with_flops``), ``export_s`` and ``export_errors`` (scalars), and the
``top_ops`` and ``op_classes`` tables (text). With ``roofline``: ``<class>/tflops``, ``gbps``, ``pct_peak``,
``pct_bandwidth``, ``intensity``, ``mfu`` (and ``mfu_fp32``, ``mfu_bf16``, ``model_tflops``), the ``roofline`` table
(text) and the ``roofline_plot`` image. With ``memory_breakdown``:
``opkit/memory/{parameters_mb,gradients_mb,optimizer_mb,activations_mb,peak_mb}``, the ``opkit/memory/modules`` and
``opkit/memory/op_classes`` tables and the ``opkit/memory/blocks`` picture. Traces go to
``<log dir>/traces/rank<r>.<step>.pt.trace.json.gz``; with ``memory_snapshot``, on CUDA, a fit that runs out of
memory leaves ``<log dir>/traces/memory_snapshot.rank<r>.<step>.pickle``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.checks import check_bools, check_choice, check_int
from lightning_opkit.core.deprecations import OpkitDeprecationWarning, renamed
from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.logging import traces_dir
from lightning_opkit.core.select import find_blocks
from lightning_opkit.core.warn import warn_once
from lightning_opkit.profiler.graph import draw_graph
from lightning_opkit.profiler.log import log_window, traces_line, window_charts
from lightning_opkit.profiler.memory import MemoryProbe, MemoryReport
from lightning_opkit.profiler.memory_log import log_memory, memory_summary, out_of_memory_lines
from lightning_opkit.profiler.memory_snapshot import Snapshot, out_of_memory
from lightning_opkit.profiler.op_times import WindowReport, peak_cpu_memory, summarize
from lightning_opkit.profiler.ranges import RANGE_KINDS, Ranges, ranges_for
from lightning_opkit.profiler.roofline.layout_speed import conv_layout
from lightning_opkit.profiler.roofline.peaks import measure_link
from lightning_opkit.profiler.roofline.report import RooflineReport, build_report
from lightning_opkit.profiler.roofline.view import summary_lines as roofline_summary
from lightning_opkit.profiler.session import Window, opens_window, settler, window_phase
from lightning_opkit.profiler.traces import write_trace_or_warn

__all__ = ["ProfilerWindows", "window_phase"]


def _check_counts(every_n_steps: int, warmup: int, active: int, top_k: int, keep_traces: int | None) -> int | None:
    """Raise for the first bad count; ``keep_traces`` as it is to be kept (its old ``0`` = keep all, warned)."""
    for name, value, low in (("every_n_steps", every_n_steps, 0), ("warmup", warmup, 0), ("active", active, 1),
                             ("top_k", top_k, 1)):
        check_int(name, value, low)
    if keep_traces == 0 and not isinstance(keep_traces, bool):
        keep_traces = None
        warnings.warn("ProfilerWindows(keep_traces=0) is deprecated and will mean off in the next release: use"
                      " keep_traces=None to keep every trace", OpkitDeprecationWarning, stacklevel=3)
    check_int("keep_traces", keep_traces, 1, optional=True)
    if every_n_steps and warmup + active > every_n_steps:
        raise ValueError(
            f"A window of `warmup` + `active` = {warmup} + {active} steps does not fit in `every_n_steps`="
            f"{every_n_steps}: windows would overlap. Use warmup + active <= every_n_steps."
        )
    return keep_traces


class ProfilerWindows(OpkitCallback):
    """Open a short torch.profiler window every ``every_n_steps`` training steps; nothing runs between windows.

    Each window runs ``warmup`` steps under the profiler unrecorded and ``active`` steps recorded, then the profiler
    is stopped and released. Per window: a gzipped Chrome/Perfetto trace under ``<log dir>/traces`` (named
    ``rank<r>.<global step>.pt.trace.json.gz``, the layout TensorBoard's profiler plugin reads), and in TensorBoard
    the mean step time, self time per operator class (ms per step and % of profiled self time), a top-``top_k`` op
    table, peak memory (``profile_memory``) and achieved FLOP/s (``with_flops``). A window cut short by validation,
    an epoch end, ``max_steps`` or an exception is closed and reported if it recorded a step, else dropped.

    Args:
        every_n_steps: training batches between window starts; the first window opens at this batch; 0 = off (the
            callback attaches nothing, as with ``enabled=False``).
        warmup: steps per window run under the profiler but not recorded.
        active: recorded steps per window.
        record_shapes: passed to ``torch.profiler.profile``.
        profile_memory: passed through; also logs the window's peak memory.
        with_stack: passed through.
        with_flops: passed through; also logs achieved FLOP/s and FLOPs per op.
        export_trace: write the window's trace file.
        top_k: rows in the top-ops table.
        gzip: write ``.json.gz`` traces (Perfetto and chrome://tracing open them).
        keep_traces: keep only this many newest trace files of this run; ``None`` = keep all. (``0`` meant keep all
            before; it still does, for this release, with a warning: ``0`` means off across the kit.)
        all_ranks: under DDP, profile every rank into its own trace files (default: rank zero only).
        span_validation: let a window stay open across a validation loop (default: validation closes it).
        roofline: per window, each op class's achieved TFLOP/s and GB/s against this device's peaks (measured once
            per process: dense GEMMs per dtype that ran, a large copy, an all_reduce under DDP), what bounds it and
            the lever, the step's MFU; a table, a picture and scalars. Turns on ``record_shapes`` and ``with_flops``.
        memory_breakdown: per window, what its first step holds (:mod:`lightning_opkit.profiler.memory`): parameters,
            gradients, optimizer state and activations saved for backward (by module and by the op class that
            produced them), the peak, and which blocks to checkpoint at what cost; tables, a picture, scalars and
            :attr:`memory_report`. Turns on ``profile_memory`` (the peak on a CPU).
        memory_snapshot: on CUDA, record the allocation history for the whole fit and, if it runs out of memory,
            dump a snapshot next to the traces (https://pytorch.org/memory_viz opens it). CUDA only: warned and
            nothing recorded elsewhere.
        ranges: named ranges for Nsight Systems and VTune (NVTX on CUDA, ITT on a CPU): one per training step
            (``opkit step <n>``) and one per module forward, ``<module path> [<op class>]``. ``"windows"``: during
            each window's steps; ``"steps"``: on every training step; ``"off"``: none. Off by default: a range per
            module forward costs host time (``benchmarks/overhead.py --suite ranges``).
        graph: draw the model's graph in TensorBoard's Graphs tab once per fit, at its first batch, from
            ``torch.export`` on fake tensors (``example_input_array``, else the batch, else its first element): no
            weight, buffer or random number changes. Where export fails the summary says why. Off by default:
            exporting a large model takes seconds to minutes.
        enabled: attach the callback; ``False`` (or its area, ``profiler``, in the environment variable
            ``OPKIT_DISABLE``) leaves it attaching nothing, said once at setup.
        log_dir: where to write opkit's TensorBoard files when the Trainer has no TensorBoard logger (by default none
            then: ``logger=False`` writes no file).
        memory: the old name of ``memory_breakdown`` (beside ``profile_memory`` it read as the same thing): it works
            for this release and warns.

    Example:
        >>> windows = ProfilerWindows(every_n_steps=200, active=3)
        >>> trainer = pl.Trainer(callbacks=[windows], logger=False)
        >>> window_phase(201, windows.every_n_steps, windows.warmup, windows.active)
        (0, 'active')
    """

    area = "profiler"

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
        keep_traces: Optional[int] = None,
        all_ranks: bool = False,
        span_validation: bool = False,
        roofline: bool = False,
        memory_breakdown: bool = False,
        memory_snapshot: bool = False,
        ranges: Literal["off", "windows", "steps"] = "off",
        graph: bool = False,
        enabled: bool = True,
        log_dir: Optional[str] = None,
        memory: Optional[bool] = None,
    ) -> None:
        super().__init__(enabled, log_dir, off="every_n_steps=0" if every_n_steps == 0 else None)
        memory_breakdown = renamed(type(self).__name__, "memory", memory, "memory_breakdown", memory_breakdown, False)
        keep_traces = _check_counts(every_n_steps, warmup, active, top_k, keep_traces)
        check_bools(record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack,
                    with_flops=with_flops, export_trace=export_trace, gzip=gzip, all_ranks=all_ranks, roofline=roofline,
                    span_validation=span_validation, memory_breakdown=memory_breakdown, memory_snapshot=memory_snapshot,
                    graph=graph)
        check_choice("ranges", ranges, RANGE_KINDS)
        # the roofline reads each op's shapes, dtypes and the profiler's GEMM FLOPs
        self._profile_options = dict(record_shapes=record_shapes or roofline, with_flops=with_flops or roofline,
                                     with_stack=with_stack, profile_memory=profile_memory or memory_breakdown)
        self.every_n_steps = every_n_steps
        self.warmup = warmup
        self.active = active
        self.record_shapes = record_shapes
        self.profile_memory = profile_memory
        self.with_stack = with_stack
        self.with_flops = with_flops
        self.export_trace, self.top_k, self.gzip = export_trace, top_k, gzip
        self.keep_traces = keep_traces
        self.all_ranks = all_ranks
        self.span_validation = span_validation
        self.roofline, self.memory_breakdown, self.memory_snapshot = roofline, memory_breakdown, memory_snapshot
        self.ranges, self.graph = ranges, graph
        self._fresh()

    def _fresh(self) -> None:
        """The state a new callback starts with (what it measured, its windows, the fit it is in)."""
        #: the snapshot written when the fit ran out of memory (``memory_snapshot``, CUDA)
        self.snapshot_file: str | None = None
        self._snapshot = Snapshot()
        self._out_of_memory = False
        #: the last window's memory view (``memory_breakdown=True``)
        self.memory_report: MemoryReport | None = None
        self._probe: MemoryProbe | None = None
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
        #: the model's graph in TensorBoard: what it was drawn from, or why it was not (``graph=True``)
        self.graph_note: str | None = None
        #: the named ranges pushed for Nsight Systems / VTune (``ranges``), while the fit runs
        self.range_marks: Ranges | None = None

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
        self._trace_dir = traces_dir(trainer, self.log_dir)
        self._enabled = self.all_ranks or trainer.is_global_zero
        wants_blocks = (self.roofline or self.memory_breakdown) and stage == "fit"
        self._blocks = find_blocks(pl_module) if wants_blocks else self._blocks
        if stage == "fit":
            self._out_of_memory, self.snapshot_file = False, None
        if self.memory_snapshot and stage == "fit" and not self._snapshot.start(trainer.strategy.root_device):
            warn_once(f"ProfilerWindows(memory_snapshot=True) records CUDA allocations; this run is on"
                          f" {trainer.strategy.root_device}: no snapshot.", stacklevel=2)
        if self.roofline and stage == "fit":
            self._roofline_off = False
            self._link_gbps = measure_link(trainer.strategy.root_device)  # a collective: every rank, here
        if stage == "fit":
            self.graph_note = None
            self.range_marks = ranges_for(self.ranges, trainer.strategy.root_device) if self._enabled else None

    @override
    def _wind_down(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(trainer, partial=True)

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        self._snapshot.stop()
        if self.range_marks is not None:
            self.range_marks.detach()  # every range popped, every hook removed, on every path

    def ended_by(self, trainer: pl.Trainer, exception: BaseException) -> None:
        """The fit failed: out of memory, the summary says where it went, and a CUDA snapshot is written once."""
        self._out_of_memory = out_of_memory(exception)
        if self._out_of_memory and self._snapshot.recording and self.snapshot_file is None:
            folder = self._trace_dir or os.path.join(trainer.default_root_dir, "traces")  # asked for: written
            self.snapshot_file = self._snapshot.dump(os.path.join(
                folder, f"memory_snapshot.rank{trainer.global_rank}.{trainer.global_step}.pickle"))

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """The op-class charts, and the roofline's where this callback draws one (empty charts are clutter)."""
        return window_charts(self.roofline)

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        line = f"profiler: {self.windows_done} window(s), {traces_line(self.trace_files, self._trace_dir)}"
        report = self.last_report
        oom = (out_of_memory_lines(self.memory_report, self.memory_breakdown, self.snapshot_file)
               if self._out_of_memory else [])
        line += f"; graph: {self.graph_note}" if self.graph_note else ""
        if self.range_marks is not None:
            line += f"; {self.range_marks.pushed} named ranges ({self.ranges})"
        if report is None:
            return [line, *oom]
        top = sorted(report.class_percent().items(), key=lambda kv: -kv[1])[:3]
        lines = [line, "  last window's top op classes: " + ", ".join(f"{c} {p:.1f}%" for c, p in top)
                 + f" ({report.step_time_ms:.2f} ms / step" + (
                     f", not counting {report.compiling_ms:.2f} ms / step of recompiling inside the window)"
                     if report.compiling_ms else ")")]
        lines += memory_summary(self.memory_report) if self.memory_report is not None else []
        return lines + (roofline_summary(self.last_roofline) if self.last_roofline is not None else []) + oom

    # the schedule: window_phase

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        batch_no = self.batches_seen
        self.batches_seen += 1
        if not self._enabled:
            return
        if self.graph and self.graph_note is None:
            self.graph_note = draw_graph(self._writer, pl_module, batch)
        if self._window is None and opens_window(batch_no, self.every_n_steps):
            self._window = Window(self.every_n_steps, self.warmup, self.active, self._profile_options)
            if self.memory_breakdown and trainer.training:
                self._probe = MemoryProbe(pl_module, self._blocks, facts_of(trainer).compiled)
                self._probe.begin(trainer.global_step)
        if self._window is not None:
            self._window.begin_batch(window_phase(batch_no, self.every_n_steps, self.warmup, self.active)[1])
        marks = self.range_marks
        if marks is not None and (self.ranges == "steps" or self._window is not None):
            marks.attach(pl_module, facts_of(trainer).compiled)
            marks.begin_step(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.range_marks is not None:
            self.range_marks.end_step()
        if self._probe is not None:
            self._probe.step_done()
        window, settle = self._window, settler(self.batches_seen - 1, self.every_n_steps, self.warmup, self.active)
        if window is not None:
            window.end_batch(before_stop=settle)
        elif settle is not None:
            settle()  # a collective: ranks without a window (all_ranks=False) join it
        if window is not None and window.ready:
            self._close(trainer, partial=False)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._probe is not None:
            self._probe.forward_done()

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._probe is not None and self._probe.gradients_unread:
            self._probe.gradients_ready()

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
        if self.range_marks is not None and self.ranges == "windows":
            self.range_marks.detach()  # between windows the model runs without a hook of ours
        if window is None:
            return
        window.stop()
        try:
            if window.step_times:
                self._report(trainer, window, partial)
        finally:
            window.release()
            if self._probe is not None:
                self._probe.close()
                self._probe = None

    def _report(self, trainer: pl.Trainer, window: Window, partial: bool) -> None:
        report = summarize(window.prof, window.step_times, use_device=window.uses_cuda)
        if self.profile_memory or self.memory_breakdown:
            report.peak_memory_bytes = (float(torch.cuda.max_memory_allocated()) if window.uses_cuda
                                        else peak_cpu_memory(window.prof))
        self.windows_done += 1
        self.last_report = report
        if self.roofline and not self._roofline_off:
            self._roofline_report(trainer, window, report)
        if self._probe is not None:
            peak = float(torch.cuda.max_memory_allocated()) if window.uses_cuda else report.peak_memory_bytes
            self.memory_report = self._probe.report(trainer.optimizers, None if peak is None else int(peak),
                                                    facts_of(trainer).checkpointed)
        step = trainer.global_step
        export_s = None
        if self.export_trace and self._trace_dir:
            export_s = write_trace_or_warn(window.prof, self._trace_dir, trainer.global_rank, step, self.gzip,
                                           self.trace_files, self.keep_traces)
            if export_s is None:
                self.export_errors += 1
                self._scalars("opkit/profiler", {"export_errors": self.export_errors}, step)
        if self._writer is not None and self._writer.active:
            log_window(self._writer, report, step, window_no=self.windows_done, partial=partial, export_s=export_s,
                       with_flops=self.with_flops, top_k=self.top_k, charted=self._charted,
                       roofline=self.last_roofline if self.roofline else None)
            if self.memory_report is not None and self._probe is not None:
                log_memory(self._writer, self.memory_report, step, self.top_k, self.windows_done)

    def _roofline_report(self, trainer: pl.Trainer, window: Window, report: WindowReport) -> None:
        try:
            self.last_roofline = build_report(
                window.prof, report.steps, report.step_time_ms / 1e3, device=trainer.strategy.root_device,
                communication_seconds=report.communication_us / 1e6,
                exposed_communication_seconds=report.exposed_communication_us / 1e6, link_gbps=self._link_gbps,
                blocks=self._blocks, cuda=window.uses_cuda, facts=facts_of(trainer), window=self.windows_done,
                conv_layout=conv_layout(trainer.lightning_module))
        except Exception as err:  # measuring the peaks can run out of memory beside the model: not worth the run
            self._roofline_off = True
            self.last_roofline = None
            warn_once(f"ProfilerWindows: the roofline failed ({type(err).__name__}: {err}); it is off for the"
                          " rest of this run, the windows go on.", stacklevel=2)
