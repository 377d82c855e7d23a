"""TensorBoard plumbing: find the run's ``SummaryWriter`` and write scalars, markdown tables and text (rank zero)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_opkit.core.text import markdown_table

__all__ = ["TensorBoardWriter", "run_log_dir"]


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


class TensorBoardWriter:
    """Write opkit's scalars and tables to the Trainer's TensorBoard writer, or to ``<log dir>/opkit``.

    Only global rank zero writes; on other ranks every method is a no-op.

    Args:
        trainer: the running trainer.

    Example:
        >>> import tempfile
        >>> writer = TensorBoardWriter(pl.Trainer(logger=False, default_root_dir=tempfile.mkdtemp()))
        >>> writer.scalar("opkit/nan/events", 1, step=10)
        >>> writer.log_dir.endswith("opkit"), writer.active
        (True, True)
        >>> writer.close()
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._writer: Any = None
        self._owned = False
        #: the run's log directory (computed on every rank: under DDP ``trainer.log_dir`` is a collective)
        self.run_dir = self.log_dir = run_log_dir(trainer)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                self._writer = logger.experiment
                return
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(self.log_dir, "opkit")
        self._writer = SummaryWriter(log_dir=self.log_dir)
        self._owned = True

    @property
    def active(self) -> bool:
        """Whether this process writes (global rank zero)."""
        return self._writer is not None

    def scalar(self, tag: str, value: float, step: int) -> None:
        """Write one scalar.

        Args:
            tag: the full tag, ``opkit/<area>/...``.
            value: a Python number (never a tensor: converting one is a host sync the caller must own).
            step: the global step.
        """
        if self._writer is not None:
            self._writer.add_scalar(tag, float(value), global_step=step)

    def scalars(self, prefix: str, values: dict[str, float | None], step: int) -> None:
        """Write a group of scalars under one prefix; ``None`` values (not measured) are left out.

        Args:
            prefix: the tags' common head, ``opkit/<area>``.
            values: tag tail -> a Python number or ``None``.
            step: the global step.

        Example:
            >>> import tempfile
            >>> writer = TensorBoardWriter(pl.Trainer(logger=False, default_root_dir=tempfile.mkdtemp()))
            >>> writer.scalars("opkit/nan", {"events": 0, "skipped_steps": 0, "not_measured": None}, step=0)
            >>> writer.close()
        """
        for name, value in values.items():
            if value is not None:
                self.scalar(f"{prefix}/{name}", value, step)

    def text(self, tag: str, markdown: str, step: int) -> None:
        """Write markdown text (a table or a report) for TensorBoard's text plugin.

        Args:
            tag: the full tag.
            markdown: the text.
            step: the global step.
        """
        if self._writer is not None:
            self._writer.add_text(tag, markdown, global_step=step)

    def image(self, tag: str, pixels: Any, step: int) -> None:
        """Write an ``(H, W, 3)`` uint8 image for TensorBoard's images tab.

        Args:
            tag: the full tag.
            pixels: the image, height by width by RGB.
            step: the global step.
        """
        if self._writer is not None:
            self._writer.add_image(tag, pixels, global_step=step, dataformats="HWC")

    def table(self, tag: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], step: int) -> None:
        """Write a markdown table.

        Args:
            tag: the full tag.
            headers: column names.
            rows: rows of cells.
            step: the global step.
        """
        self.text(tag, markdown_table(headers, rows), step)

    def custom_scalars(self, layout: dict[str, Any]) -> None:
        """Write a TensorBoard custom-scalars layout (the Custom Scalars tab).

        Args:
            layout: category -> chart title -> ``["Multiline", [tag regexes]]``.
        """
        if self._writer is not None:
            self._writer.add_custom_scalars(layout)

    def flush(self) -> None:
        """Flush pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush, and close the writer if opkit created it (a logger's writer belongs to the logger)."""
        if self._writer is None:
            return
        self._writer.flush()
        if self._owned:
            self._writer.close()
        self._writer = None
