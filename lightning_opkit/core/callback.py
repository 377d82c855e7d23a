"""What every opkit callback repeats: its writer, its patches, the run summary, a detach that may run again.

A detach runs at teardown, on an exception and at the next fit's setup; each of them is safe after the others.
"""

from __future__ import annotations

import functools
import os
from typing import Any, ClassVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_opkit.core.kit import HearsOfFailure, offering
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.strategies import check_strategy
from lightning_opkit.core.summary import report, start_summary
from lightning_opkit.core.switch import AREAS, ENV, disabled_areas

__all__ = ["OpkitCallback"]

#: every hook Lightning calls on a callback: a callback that is off answers each with nothing
_HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_") or name in ("teardown", "load_state_dict"))


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _no_state() -> dict[str, Any]:
    return {}  # Lightning keeps no entry for an empty state: a later run with the callback on starts afresh


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

    #: the callback's area, as in its tags ``opkit/<area>/...`` and in ``OPKIT_DISABLE``
    area: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every callback's own ``setup`` runs after the strategy check: a refused strategy fails before any attach."""
        super().__init_subclass__(**kwargs)
        own = vars(cls).get("setup")
        if own is None:
            return

        @functools.wraps(own)
        def setup(self: Any, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            check_strategy(trainer, type(self).__name__)
            own(self, trainer, pl_module, stage)

        cls.setup = setup  # type: ignore[method-assign]

    def __init__(self, enabled: bool = True, log_dir: str | None = None, off: str | None = None) -> None:
        """Check and keep the arguments every callback takes.

        Args:
            enabled: the callback's ``enabled`` argument.
            log_dir: the callback's ``log_dir`` argument.
            off: why the callback's own arguments leave it nothing to do (``"every_n_steps=0"``), else ``None``.
        """
        if not isinstance(enabled, bool):
            raise ValueError(f"{type(self).__name__}(enabled={enabled!r}): expected True or False")
        if log_dir is not None and not (isinstance(log_dir, str) and log_dir):
            raise ValueError(f"{type(self).__name__}(log_dir={log_dir!r}): expected a directory path or None")
        #: where opkit writes TensorBoard files (and traces) of its own when the Trainer has no TensorBoard logger
        self.log_dir = log_dir
        self._writer: LogWriter | None = None
        self._patches = Patches()
        self._said_off = False
        self._summary_due = False  # a fit was set up and its summary not written yet
        if self.area and self.area not in AREAS:
            raise ValueError(f"{type(self).__name__}.area={self.area!r}: expected one of {AREAS}")
        disabled = self.area in disabled_areas()
        #: whether the callback attaches (``enabled`` and its area not in ``OPKIT_DISABLE``)
        self.enabled = enabled and not disabled and off is None
        self._off_because = (f"{ENV}={os.environ.get(ENV, '')}" if disabled else
                             "enabled=False" if not enabled else str(off))
        if not self.enabled:
            for name in _HOOKS:
                setattr(self, name, _nothing)
            self.setup = self._say_off  # type: ignore[method-assign]
            self.state_dict = _no_state  # type: ignore[method-assign]

    def _say_off(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._said_off:
            self._said_off = True
            rank_zero_info(f"opkit: {type(self).__name__} is off ({self._off_because}): it attaches nothing.")

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        raise NotImplementedError

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """This callback's charts in TensorBoard's Custom Scalars tab: category -> title -> ``["Multiline", tags]``."""
        return {}

    @property
    def writer(self) -> LogWriter | None:
        """Where this callback writes in the stage running now (``None`` outside one)."""
        return self._writer

    def _open_writer(self, trainer: pl.Trainer, stage: str) -> LogWriter:
        """A fresh writer for this stage; at a fit's setup, also arm the run summary."""
        if self._writer is not None:
            self._writer.close()
        self._writer = LogWriter(trainer, self.log_dir)
        if stage == "fit":
            start_summary(self, trainer, self._writer)
            self._summary_due = True
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
            self._end_summary(trainer)
        self._detach(trainer, pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        for member in offering(trainer, HearsOfFailure):  # the first callback writes the summary: all know first
            member.ended_by(trainer, exception)
        self._wind_down(trainer, pl_module)
        self._end_summary(trainer, exception)
        self._detach(trainer, pl_module)

    def _end_summary(self, trainer: pl.Trainer, exception: BaseException | None = None) -> None:
        """At the end of a fit or on its exception: the summary, once (first opkit callback only)."""
        if self._summary_due:
            self._summary_due = False
            report(trainer, self, self._writer, exception)


