"""What every opkit callback repeats: its writer, its patches, the run summary, a detach that may run again.

A detach runs at teardown, on an exception and at the next fit's setup; each of them is safe after the others.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_opkit.core.kit import HearsOfFailure, offering
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.summary import end_summary, start_summary

__all__ = ["OpkitCallback"]


class OpkitCallback(Callback):
    """Base of the opkit callbacks: a writer, patches, the summary, teardown and exception handled alike.

    Subclasses fill in :meth:`summary_lines`, and optionally :meth:`_wind_down` (finish what is open, before the
    summary) and :meth:`_release` (undo their own state, after it).

    On ``teardown`` and ``on_exception`` alike: wind down, write the run summary (first opkit callback only), restore
    every patch and hook, release, close the writer. Everything after the wind-down is idempotent.

    Example:
        >>> class Counter(OpkitCallback):
        ...     def summary_lines(self):
        ...         return ["counter: nothing counted"]
        >>> Counter().summary_lines()
        ['counter: nothing counted']
    """

    def __init__(self) -> None:
        self._writer: LogWriter | None = None
        self._patches = Patches()

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        raise NotImplementedError

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """This callback's charts in TensorBoard's Custom Scalars tab: category -> title -> ``["Multiline", tags]``."""
        return {}

    def _open_writer(self, trainer: pl.Trainer, stage: str) -> LogWriter:
        """A fresh writer for this stage; at a fit's setup, also arm the run summary."""
        if self._writer is not None:
            self._writer.close()
        self._writer = LogWriter(trainer)
        if stage == "fit":
            start_summary(self, trainer, self._writer)
        return self._writer

    def _scalars(self, prefix: str, values: dict[str, float | None], step: int) -> None:
        if self._writer is not None:
            self._writer.scalars(prefix, values, step)

    def _wind_down(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish what is still open before the summary is written (a profiler window); nothing by default."""

    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        """Undo this callback's own state beyond patches and the writer; nothing by default."""

    def _detach(self, trainer: pl.Trainer | None = None, pl_module: pl.LightningModule | None = None) -> None:
        self._patches.restore()
        self._release(trainer, pl_module)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._wind_down(trainer, pl_module)
        if stage == "fit":
            end_summary(self, trainer, self._writer)
        self._detach(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        for member in offering(trainer, HearsOfFailure):  # the first callback writes the summary: all know first
            member.ended_by(trainer, exception)
        self._wind_down(trainer, pl_module)
        end_summary(self, trainer, self._writer, exception)
        self._detach(trainer, pl_module)


