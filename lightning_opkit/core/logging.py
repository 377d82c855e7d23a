"""The one sink every opkit callback writes through: TensorBoard first, and every other logger of the Trainer.

Scalars go to TensorBoard and to each other logger's ``log_metrics`` (CSVLogger, WandbLogger, MLFlowLogger, ...), so
a run without TensorBoard still has every ``opkit/*`` figure. Text and pictures go where a logger has a way: W&B's
``log_text`` / ``log_image``, MLflow's artifacts, and files beside a CSVLogger's ``metrics.csv``
(``opkit/<tag>.md`` and ``.png``, the latest of each). Only global rank zero writes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger

from lightning_opkit.core import tags
from lightning_opkit.core.text import markdown_table

__all__ = ["LogWriter", "figure_pixels", "run_log_dir", "traces_dir"]


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
            tags.check(tag, "scalar")
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
        tags.check(tag, "text")
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
        tags.check(tag, "image")
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
