"""The one sink every opkit callback writes through: TensorBoard first, and every other logger of the Trainer.

Scalars go to TensorBoard and to each other logger's ``log_metrics`` (CSVLogger, WandbLogger, MLFlowLogger, ...), so
a run without TensorBoard still has every ``opkit/*`` figure. Text and pictures go where a logger has a way: W&B's
``log_text`` / ``log_image``, MLflow's artifacts, and files beside a CSVLogger's ``metrics.csv``
(``opkit/<tag>.md`` and ``.png``, the latest of each). Only global rank zero writes.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

__all__ = ["TAGS", "LogWriter", "Tag", "UnlistedTagWarning", "check_tag", "figure_pixels", "markdown_table",
           "run_log_dir", "tags_markdown", "traces_dir"]

def run_log_dir(trainer: pl.Trainer) -> str:
    """The directory this run logs to: the TensorBoard logger's ``log_dir``, else ``trainer.log_dir`` or root dir.

    Args:
        trainer: the running trainer.

    Example:
        >>> run_log_dir(pl.Trainer(logger=False, default_root_dir="/tmp/x"))
        '/tmp/x'
    """
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            return logger.log_dir
    return trainer.log_dir or trainer.default_root_dir


def traces_dir(trainer: pl.Trainer, log_dir: str | None) -> str:
    """Where a callback's traces go: ``<log_dir>/traces``, else ``<run log dir>/traces``; ``""`` for none.

    None when the Trainer has no logger and no ``log_dir`` was given: ``logger=False`` writes no file.

    Args:
        trainer: the running trainer (every rank calls this: ``trainer.log_dir`` is a collective under DDP).
        log_dir: the callback's ``log_dir``.

    Example:
        >>> traces_dir(pl.Trainer(logger=False), None), traces_dir(pl.Trainer(logger=False), "/tmp/x")
        ('', '/tmp/x/traces')
    """
    if log_dir is None and not trainer.loggers:
        return ""
    return os.path.join(log_dir or run_log_dir(trainer), "traces")


def figure_pixels(figure: Any) -> np.ndarray:
    """A matplotlib figure rendered to an ``(H, W, 3)`` uint8 array, at the figure's own size and dpi.

    Example:
        >>> from matplotlib.figure import Figure
        >>> figure_pixels(Figure(figsize=(2, 1), dpi=50)).shape
        (50, 100, 3)
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render a markdown table, as TensorBoard's text plugin shows it.

    Args:
        headers: column names.
        rows: one sequence of cells per row; floats in fixed point with three decimals (never ``1.372e+04``).

    Example:
        >>> print(markdown_table(["a", "b"], [[1, 13720.5]]))
        | a | b |
        |---|---|
        | 1 | 13720.500 |
    """

    def cell(value: Any) -> str:
        text = _fixed(value) if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fixed(value: float) -> str:
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == 0 or abs(value) >= 1e-3:
        return f"{value:.3f}"
    return f"{value:.1e}"  # below a thousandth, three decimals would read as zero


def _file_name(tag: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", tag.removeprefix("opkit/"))


class LogWriter:
    """Write opkit's scalars, tables and pictures to TensorBoard and to the Trainer's other loggers.

    TensorBoard: every ``TensorBoardLogger`` of the Trainer (each gets every tag); without one, a writer of opkit's own
    in ``log_dir`` when the user gave one, else none (``logger=False`` writes no file). Only global rank zero writes; on
    other ranks every method is a no-op.

    Args:
        trainer: the running trainer.
        log_dir: where opkit writes TensorBoard event files of its own when the Trainer has no TensorBoard logger.

    Example:
        >>> import tempfile
        >>> writer = LogWriter(pl.Trainer(logger=False), log_dir=tempfile.mkdtemp())
        >>> writer.scalar("opkit/nan/events", 1, step=10)
        >>> writer.active, len(writer.tensorboard_dirs)
        (True, 1)
        >>> writer.close()
        >>> LogWriter(pl.Trainer(logger=False)).active  # nothing to write to
        False
    """

    def __init__(self, trainer: pl.Trainer, log_dir: str | None = None) -> None:
        self._writers: list[Any] = []
        self._owned = False
        self._rank_zero = trainer.is_global_zero
        #: the Trainer's loggers other than TensorBoard, each written to as far as it has a way
        self.others: list[Logger] = []
        #: the run's log directory (computed on every rank: under DDP ``trainer.log_dir`` is a collective)
        self.run_dir = self.log_dir = run_log_dir(trainer) if log_dir is None else log_dir
        #: the directories of the TensorBoard event files written (one per TensorBoard logger; empty: none)
        self.tensorboard_dirs: list[str] = []
        if not self._rank_zero:
            return
        self.others = [lg for lg in trainer.loggers if not isinstance(lg, TensorBoardLogger)]
        boards = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
        self._writers = [lg.experiment for lg in boards]
        self.tensorboard_dirs = [lg.log_dir for lg in boards]
        if boards or log_dir is None:
            return  # no TensorBoard logger and no log_dir: the user asked for no logs, no files of opkit's own either
        from torch.utils.tensorboard import SummaryWriter

        self._writers = [SummaryWriter(log_dir=log_dir)]
        self.tensorboard_dirs = [log_dir]
        self._owned = True

    @property
    def tensorboard_dir(self) -> str | None:
        """The first directory of TensorBoard event files written, or ``None`` when there are none."""
        return self.tensorboard_dirs[0] if self.tensorboard_dirs else None

    @property
    def active(self) -> bool:
        """Whether this process writes anywhere (global rank zero, with TensorBoard or another logger)."""
        return self._rank_zero and (bool(self._writers) or bool(self.others))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Write one scalar.

        Args:
            tag: the full tag, ``opkit/<area>/...``.
            value: a Python number (never a tensor: converting one is a host sync the caller must own).
            step: the global step.
        """
        self.scalars(tag.rpartition("/")[0], {tag.rpartition("/")[2]: value}, step)

    def scalars(self, prefix: str, values: dict[str, float | None], step: int) -> None:
        """Write a group of scalars under one prefix; ``None`` values (not measured) are left out.

        Args:
            prefix: the tags' common head, ``opkit/<area>``.
            values: tag tail -> a Python number or ``None``.
            step: the global step.

        Example:
            >>> import tempfile
            >>> writer = LogWriter(pl.Trainer(logger=False), log_dir=tempfile.mkdtemp())
            >>> writer.scalars("opkit/nan", {"events": 0, "skipped_steps": 0, "not_measured": None}, step=0)
            >>> writer.close()
        """
        if not self.active:
            return
        metrics = {f"{prefix}/{name}": float(value) for name, value in values.items() if value is not None}
        for tag, value in metrics.items():
            check_tag(tag, "scalar")
            for board in self._writers:
                board.add_scalar(tag, value, global_step=step)
        for logger in self.others:
            if metrics:
                logger.log_metrics(metrics, step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        """Write markdown text (a table or a report): TensorBoard's text plugin, and the other loggers' ways.

        Args:
            tag: the full tag.
            markdown: the text.
            step: the global step.
        """
        if not self.active:
            return
        check_tag(tag, "text")
        for board in self._writers:
            board.add_text(tag, markdown, global_step=step)
        for logger in self.others:
            other: Any = logger  # the ways below are not on Lightning's base Logger
            if isinstance(logger, CSVLogger):
                self._beside_csv(logger, tag, ".md", f"step {step}\n\n{markdown}\n")
            elif callable(getattr(other, "log_text", None)):  # W&B: a one-cell table per tag
                other.log_text(key=tag, columns=["markdown"], data=[[markdown]], step=step)
            elif callable(getattr(getattr(other, "experiment", None), "log_text", None)) and getattr(
                    other, "run_id", None):  # MLflow: an artifact per step
                other.experiment.log_text(other.run_id, markdown, f"{_file_name(tag)}.{step}.md")

    def figure(self, tag: str, figure: Any, step: int) -> None:
        """Write a matplotlib figure: TensorBoard's images tab, and the other loggers' ways.

        Args:
            tag: the full tag.
            figure: a ``matplotlib.figure.Figure``.
            step: the global step.
        """
        if not self.active:
            return
        check_tag(tag, "image")
        pixels = figure_pixels(figure)
        for board in self._writers:
            board.add_image(tag, pixels, global_step=step, dataformats="HWC")
        for logger in self.others:
            other: Any = logger
            if isinstance(logger, CSVLogger):
                path = self._beside_csv(logger, tag, ".png", None)
                figure.savefig(path)
            elif callable(getattr(other, "log_image", None)):  # W&B
                other.log_image(key=tag, images=[pixels], step=step)
            elif callable(getattr(getattr(other, "experiment", None), "log_figure", None)) and getattr(
                    other, "run_id", None):  # MLflow
                other.experiment.log_figure(other.run_id, figure, f"{_file_name(tag)}.{step}.png")
        # A figure is a web of references (figure, axes, artists, transforms): emptied, reference counting frees it
        # now rather than at the next full garbage collection.
        figure.clear()

    @staticmethod
    def _beside_csv(logger: CSVLogger, tag: str, suffix: str, content: str | None) -> str:
        folder = os.path.join(logger.log_dir, "opkit")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, _file_name(tag) + suffix)
        if content is not None:
            with open(path, "w") as f:
                f.write(content)
        return path

    def table(self, tag: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        """Write a markdown table.

        Args:
            tag: the full tag.
            headers: column names.
            rows: rows of cells.
            step: the global step.
        """
        self.text(tag, markdown_table(headers, rows), step)

    def graph(self, graph_def: Any) -> None:
        """Write a model graph (a TensorBoard ``GraphDef``) for the Graphs tab; TensorBoard only.

        Args:
            graph_def: ``tensorboard.compat.proto.graph_pb2.GraphDef``.
        """
        from tensorboard.compat.proto.event_pb2 import Event

        for board in self._writers:
            # SummaryWriter.add_graph would trace the model with torch.jit; its file writer takes the graph as drawn
            board.file_writer.add_event(Event(graph_def=graph_def.SerializeToString()))

    def custom_scalars(self, layout: dict[str, Any]) -> None:
        """Write a TensorBoard custom-scalars layout (the Custom Scalars tab).

        Args:
            layout: category -> chart title -> ``["Multiline", [tag regexes]]``.
        """
        for board in self._writers:
            board.add_custom_scalars(layout)

    def flush(self) -> None:
        """Flush pending events and rows to disk."""
        for board in self._writers:
            board.flush()
        for logger in self.others:
            logger.save()

    def close(self) -> None:
        """Flush, and close the writer if opkit created it (a logger's writer belongs to the logger)."""
        if not self.active:
            return
        self.flush()
        if self._owned:
            self._writers[0].close()
        self._writers = []
        self.others = []


# The tag table. Every tag opkit writes: its kind, unit, when it is written and by whom; the docs' tag reference
# (docs/tags.md, `make docs-tags`) is made from it. The writer checks each tag it writes against it and warns, once
# per tag, of one it does not hold (the test suite turns that warning into an error), so the reference cannot fall
# behind the code. ``<class>`` stands for an operator class (lightning_opkit.opclass).


@dataclass(frozen=True)
class Tag:
    """One tag (or a family, with ``<class>`` in it).

    Args:
        name: ``opkit/<area>/...``.
        kind: ``"scalar"``, ``"text"`` or ``"image"``.
        unit: the scalar's unit (``""`` for text and images).
        when: when it is written, and with which option.
        meaning: what it holds.
    """

    name: str
    kind: str
    unit: str
    when: str
    meaning: str


_WINDOW = "each profiler window's end"
_ROOF = "each window, `roofline=True`"
_MEM = "each window, `memory_breakdown=True`"
_CENSUS = "each census step (`census_every_n_steps`)"
_COUNTERS = "each event's step and each epoch end"
_COMPILE = "when they change (checked each step)"

TAGS: tuple[Tag, ...] = (
    Tag("opkit/summary", "text", "", "the fit's end or exception (first opkit callback, rank zero)",
        "where the logs are, the `tensorboard --logdir` command, and every callback's findings"),
    # PrecisionPolicy
    Tag("opkit/precision/policy", "text", "", "setup, and after `rules='auto'` decides",
        "the effective table, why (the evidence under `auto`), the module overrides"),
    Tag("opkit/precision/sensitivity", "text", "", "`auto` or `measure`, once measured",
        "per class x dtype: ops per step, fp32 ms, speed against fp32, chosen; the whole-step candidates"),
    Tag("opkit/precision/decision", "text", "", "`auto`: the decision, and again when the trials end",
        "the chosen table's error beside plain bf16-mixed's, trial medians, each class's dtype and evidence, and"
        " each Linear's float8 figures and verdict where float8 was measured"),
    Tag("opkit/precision/measure_s", "scalar", "s", "each measurement of `rules='auto'`",
        "seconds the measurement took"),
    Tag("opkit/precision/census", "text", "", _CENSUS,
        "class, dtype it ran in, decided by, calls, relative error, underflow, max |output|, fp16 headroom"),
    Tag("opkit/precision/<class>/calls", "scalar", "calls", _CENSUS, "the class's calls in the census step"),
    Tag("opkit/precision/<class>/rel_error", "scalar", "ratio", _CENSUS,
        "worst relative error of the class's 16-bit outputs against an fp32 recompute"),
    Tag("opkit/precision/<class>/underflow_frac", "scalar", "fraction", _CENSUS,
        "share of the class's 16-bit outputs lost to underflow"),
    Tag("opkit/precision/<class>/headroom_bits", "scalar", "bits", _CENSUS,
        "least fp16 headroom below overflow (classes that ran in fp16)"),
    # NaNDetector
    Tag("opkit/nan/events", "scalar", "events", _COUNTERS, "cumulative faults (non-finite values and spikes)"),
    Tag("opkit/nan/skipped_steps", "scalar", "steps", _COUNTERS, "optimizer steps skipped (`action='skip'`)"),
    Tag("opkit/nan/consecutive_skips", "scalar", "steps", _COUNTERS, "skips in a row (`max_consecutive_skips`)"),
    Tag("opkit/nan/repairs", "scalar", "modules", _COUNTERS, "modules pinned to fp32 after a precision fault"),
    Tag("opkit/nan/spikes", "scalar", "spikes", _COUNTERS, "cumulative loss and gradient-norm spikes"),
    Tag("opkit/nan/dead_parameters", "scalar", "parameters", f"{_COUNTERS}, `dead_after`",
        "parameters and experts with no gradient for `dead_after` steps"),
    Tag("opkit/nan/dead_parameters", "text", "", "when one is found (`dead_after`)",
        "each dead parameter or expert: since which step, frozen or not"),
    Tag("opkit/nan/report", "text", "", "each event", "the report as a paragraph and a table (cause and advice in it)"),
    Tag("opkit/nan/cause", "text", "", "each event whose cause was replayed", "the cause and what to try"),
    # ProfilerWindows
    Tag("opkit/profiler/windows", "scalar", "windows", _WINDOW, "windows so far"),
    Tag("opkit/profiler/step_time_ms", "scalar", "ms", _WINDOW, "mean wall time of the window's recorded steps"),
    Tag("opkit/profiler/profiled_steps", "scalar", "steps", _WINDOW, "recorded steps in the window"),
    Tag("opkit/profiler/framework_ms", "scalar", "ms / step", _WINDOW,
        "self time of framework spans (ProfilerStep, Optimizer.step, data loading), apart from the class shares"),
    Tag("opkit/profiler/peak_memory_mb", "scalar", "MB", f"{_WINDOW}, `profile_memory` or `memory_breakdown`",
        "CUDA: the allocator's maximum; CPU: the peak of the window's allocations"),
    Tag("opkit/profiler/gflops_per_s", "scalar", "GFLOP/s", f"{_WINDOW}, `with_flops`", "the profiler's FLOPs / time"),
    Tag("opkit/profiler/export_s", "scalar", "s", f"{_WINDOW}, `export_trace`", "time to write the trace"),
    Tag("opkit/profiler/export_errors", "scalar", "exports", "a trace export that failed",
        "failed exports (unwritable directory, full disk); training goes on"),
    Tag("opkit/profiler/<class>/self_ms", "scalar", "ms / step", _WINDOW, "the class's self time per step"),
    Tag("opkit/profiler/<class>/percent", "scalar", "%", _WINDOW, "the class's share of profiled self time"),
    Tag("opkit/profiler/communication/ms", "scalar", "ms / step", f"{_WINDOW}, when collectives ran",
        "communication wall time (merged intervals)"),
    Tag("opkit/profiler/communication/exposed_ms", "scalar", "ms / step", f"{_WINDOW}, when collectives ran",
        "communication no compute overlapped"),
    Tag("opkit/profiler/communication/exposed_percent", "scalar", "%", f"{_WINDOW}, when collectives ran",
        "exposed communication as a share of the step"),
    Tag("opkit/profiler/top_ops", "text", "", _WINDOW, "the top `top_k` ops: calls, self and total ms, %, GFLOP"),
    Tag("opkit/profiler/op_classes", "text", "", _WINDOW, "time per operator class"),
    Tag("opkit/profiler/<class>/tflops", "scalar", "TFLOP/s", _ROOF, "the class's achieved FLOP rate"),
    Tag("opkit/profiler/<class>/gbps", "scalar", "GB/s", _ROOF, "the class's achieved bytes per second"),
    Tag("opkit/profiler/<class>/pct_peak", "scalar", "%", _ROOF, "of the measured GEMM peak of its dtype(s)"),
    Tag("opkit/profiler/<class>/pct_bandwidth", "scalar", "%", _ROOF, "of the measured copy bandwidth"),
    Tag("opkit/profiler/<class>/intensity", "scalar", "FLOP/B", _ROOF, "arithmetic intensity"),
    Tag("opkit/profiler/communication/gbps", "scalar", "GB/s", f"{_ROOF}, when collectives ran",
        "collective bytes per second"),
    Tag("opkit/profiler/communication/pct_link", "scalar", "%", f"{_ROOF}, under DDP / FSDP2",
        "of the measured all_reduce bandwidth"),
    Tag("opkit/profiler/mfu", "scalar", "%", _ROOF,
        "step MFU against the peaks of the dtypes that ran (none above 100%)"),
    Tag("opkit/profiler/mfu_fp32", "scalar", "%", _ROOF,
        "step MFU against the fp32 peak (where fp32 GEMMs ran; none above 100%)"),
    Tag("opkit/profiler/mfu_bf16", "scalar", "%", _ROOF,
        "step MFU against the bf16 peak (where bf16 GEMMs ran; none above 100%)"),
    Tag("opkit/profiler/model_tflops", "scalar", "TFLOP/s", _ROOF, "the step's GEMM-like FLOPs over its time"),
    Tag("opkit/profiler/roofline", "text", "", _ROOF, "the peaks, per-class rows, each class's lever, the MFU line"),
    Tag("opkit/profiler/roofline_plot", "image", "", _ROOF,
        "intensity against achieved TFLOP/s per class, a roof per measured dtype"),
    Tag("opkit/memory/parameters_mb", "scalar", "MB", _MEM, "parameters (local shards), exact"),
    Tag("opkit/memory/gradients_mb", "scalar", "MB", _MEM, "gradients before the optimizer step, exact"),
    Tag("opkit/memory/optimizer_mb", "scalar", "MB", _MEM, "the optimizer's state, exact"),
    Tag("opkit/memory/activations_mb", "scalar", "MB", _MEM, "what autograd saves for backward, each storage once"),
    Tag("opkit/memory/peak_mb", "scalar", "MB", _MEM, "CUDA: the allocator's peak; CPU: the profiler's"),
    Tag("opkit/memory/modules", "text", "", _MEM, "bytes by kind, activations by block and module, the lever"),
    Tag("opkit/memory/op_classes", "text", "", _MEM, "activations by the op class that produced them"),
    Tag("opkit/memory/blocks", "image", "", _MEM, "stacked bars per block by producing op class"),
    # TorchCompile
    Tag("opkit/compile/config", "text", "", "setup", "the settings and the compiled regions"),
    Tag("opkit/compile/compile_time_s", "scalar", "s", _COMPILE, "cumulative compile time"),
    Tag("opkit/compile/compiles", "scalar", "compiles", _COMPILE, "cumulative compilations"),
    Tag("opkit/compile/graphs", "scalar", "graphs", _COMPILE, "graphs compiled"),
    Tag("opkit/compile/graph_breaks", "scalar", "breaks", _COMPILE, "graph breaks"),
    Tag("opkit/compile/graph_break_reasons", "text", "", _COMPILE, "each break's reason and count"),
    Tag("opkit/compile/recompiles", "scalar", "recompiles", _COMPILE, "recompilations"),
    Tag("opkit/compile/recompile_reasons", "text", "", _COMPILE, "function, the guard that failed, count"),
    Tag("opkit/compile/step_time_ms", "scalar", "ms", _COMPILE, "median steady-state step time (no compile in it)"),
    Tag("opkit/compile/regions", "text", "", "regional compile, when they change",
        "per region: calls, compiles, compile s, graphs, breaks, recompiles, measured speedup, compiled or eager"),
    Tag("opkit/compile/eager_regions", "scalar", "regions", "regional compile, when they change",
        "regions running eagerly (measured slower compiled, or after recompiles)"),
    Tag("opkit/compile/eager_fallback", "scalar", "0/1", "compilation failed", "1: the run went on eagerly"),
    Tag("opkit/compile/error", "text", "", "compilation failed", "the error, and that training continues eagerly"),
    # ActivationCheckpointing
    Tag("opkit/checkpointing/config", "text", "", "setup", "the checkpointed blocks and what each keeps"),
    Tag("opkit/checkpointing/saved_mb_without", "scalar", "MB", "once measured (`measure=True`)",
        "activation bytes saved for backward without checkpointing (median step)"),
    Tag("opkit/checkpointing/saved_mb_with", "scalar", "MB", "once measured (`measure=True`)",
        "activation bytes saved with checkpointing (median step)"),
    Tag("opkit/checkpointing/saved_cut", "scalar", "fraction", "once measured (`measure=True`)",
        "share of the saved bytes checkpointing removes"),
    Tag("opkit/checkpointing/step_ms_without", "scalar", "ms", "once measured (`measure=True`)",
        "median step time without checkpointing"),
    Tag("opkit/checkpointing/step_ms_with", "scalar", "ms", "once measured (`measure=True`)",
        "median step time with it"),
    Tag("opkit/checkpointing/time_ratio", "scalar", "ratio", "once measured (`measure=True`)",
        "step time with over without"),
    Tag("opkit/checkpointing/report", "text", "", "once measured (`measure=True`)", "the price in one line"),
)


class UnlistedTagWarning(UserWarning):
    """A tag written that :data:`TAGS` does not list: the tag reference is behind the code."""


def _pattern(name: str) -> str:
    return re.escape(name).replace(re.escape("<class>"), "[a-z_0-9]+")


@cache
def _listed(tag: str, kind: str) -> bool:
    return any(t.kind == kind and re.fullmatch(_pattern(t.name), tag) for t in TAGS)


def check_tag(tag: str, kind: str) -> None:
    """Warn (:class:`UnlistedTagWarning`, once per tag) when ``tag`` of ``kind`` is not in :data:`TAGS`.

    Example:
        >>> check_tag("opkit/profiler/matmul/self_ms", "scalar")
    """
    if not _listed(tag, kind):
        warnings.warn(f"opkit writes {kind} {tag!r}, which lightning_opkit/core/logging.py does not list",
                      UnlistedTagWarning, stacklevel=3)


def tags_markdown() -> str:
    """The tag reference page (``docs/tags.md``), from :data:`TAGS`."""
    lines = ["# TensorBoard tags", "",
             "Every tag opkit writes, made from `lightning_opkit/core/logging.py` (`make docs-tags`); the test suite"
             " fails on a tag written that is not listed here. `<class>` is an operator class"
             " ([how it works](how-it-works.md#the-operator-classes)). Scalars go to TensorBoard's Scalars tab"
             " and to the Trainer's other loggers; text to the Text tab (a CSV logger: `.md` files beside its"
             " metrics); images to the Images tab. All are written by global rank zero.", ""]
    area = ""
    for tag in TAGS:
        head = tag.name.split("/")[1]
        if head != area:
            area = head
            lines += ["", f"## `opkit/{area}`", "", "| tag | kind | unit | written | what it holds |",
                      "|---|---|---|---|---|"]
        lines.append(f"| `{tag.name}` | {tag.kind} | {tag.unit or '-'} | {tag.when} | {tag.meaning} |")
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"
