"""What NaNDetector does about a fault: repair it where the cause is precision, count it, log it, then act.

The detector finds a fault and a replay builds its report (:mod:`~lightning_opkit.nan.replays`); from there the
report goes through :class:`Actions` alone: amended with the repair (:mod:`~lightning_opkit.nan.repair`) or with what
loss scaling cannot do, kept, written with the run's counters (to the writer the detector opened), and acted on:
``raise`` a :class:`NonFiniteError`, ``skip`` the optimizer step (:mod:`~lightning_opkit.nan.skip`), ``warn`` once a
kind of fault, or ``stop``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl

from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.kit import PinsModules, offering
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.repair import Repairs
from lightning_opkit.nan.report import NaNReport, NonFiniteError, amended, format_report, write_report
from lightning_opkit.nan.skip import StepSkipper

if TYPE_CHECKING:
    from lightning_opkit.core.logging import LogWriter
    from lightning_opkit.nan.dead import DeadWatch

__all__ = ["Actions", "pinner"]


def pinner(trainer: pl.Trainer) -> PinsModules | None:
    """The attached precision policy that pins a module to a dtype, if any."""
    return next(offering(trainer, PinsModules), None)


class Actions:
    """The run's faults and what was done about each: the reports, the steps skipped, the modules pinned.

    Args:
        action: ``"raise"``, ``"skip"``, ``"warn"`` or ``"stop"`` (see :class:`~lightning_opkit.NaNDetector`).
        max_consecutive_skips: with ``"skip"``, raise once this many steps in a row were skipped.
        repair: pin a precision fault's culprit to fp32 when the run goes on.
        skipper: the detector's step skipper (a skipped step is left out there).
        dead: the detector's dead-parameter watch, if any (its count is one of the counters written).

    Example:
        >>> from lightning_opkit.core.patch import Patches
        >>> actions = Actions("skip", 2, repair=False, skipper=StepSkipper(Patches()))
        >>> actions.goes_on, actions.skipped_steps, actions.reports
        (True, 0, [])
    """

    def __init__(self, action: str, max_consecutive_skips: int, repair: bool, skipper: StepSkipper,
                 dead: DeadWatch | None = None) -> None:
        self.action, self.max_consecutive_skips, self.repair = action, max_consecutive_skips, repair
        self._skipper, self._dead = skipper, dead
        #: where reports and counters are written: the detector's writer for the stage running (``None``: nowhere)
        self.writer: LogWriter | None = None
        #: every event of this run, typed
        self.reports: list[NaNReport] = []
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.repairs = Repairs()

    @property
    def goes_on(self) -> bool:
        """Whether the run goes on after one more fault: ``warn``, or ``skip`` under its limit."""
        return self.action == "warn" or (
            self.action == "skip" and self.consecutive_skips + 1 <= self.max_consecutive_skips)

    def counters(self) -> dict[str, float | None]:
        """The ``opkit/nan/*`` counters: events, skipped and consecutive skips, repairs, spikes, dead parameters."""
        return {"events": len(self.reports), "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "repairs": len(self.repairs.pinned),
                "spikes": sum(r.kind == "spike" for r in self.reports),
                "dead_parameters": len(self._dead.found) if self._dead is not None else None}

    def write(self, trainer: pl.Trainer, report: NaNReport | None = None) -> None:
        """Write the counters, and ``report`` if given, at the Trainer's step (nothing without a writer)."""
        if self.writer is None:
            return
        self.writer.scalars("opkit/nan", self.counters(), trainer.global_step)
        if report is not None:
            write_report(self.writer, report, trainer.global_step)

    def good_step(self) -> None:
        """A checked step was finite: the run of skipped steps is over."""
        self.consecutive_skips = 0

    def act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport, late: bool = False) -> None:
        """Act on a fault; ``late``: a step late (``decide="device"``), its update already left out on the device."""
        goes_on = self.goes_on
        report = self._kept(trainer, pl_module, report, goes_on)
        # The buffers the bad forward wrote are put back whatever the action: a caught NonFiniteError leaves a model
        # that still evaluates. A step late they were put back on the device; what goes back now is what the next
        # step's forward wrote, when the run ends here.
        if not late or not goes_on:
            self._skipper.restore_buffers()
        if self.action == "skip" and not goes_on:
            self.write(trainer, report)
            raise NonFiniteError(report, reason=f"NaNDetector skipped {self.consecutive_skips} steps in a row"
                                                f" (max_consecutive_skips={self.max_consecutive_skips}).")
        if self.action == "raise":
            self.write(trainer, report)
            raise NonFiniteError(report)
        if not late or self.action == "stop":
            # the optimizer step itself is left out (see skip.py); a step late, with stop, the next one is: the run
            # ends on the weights from before the bad batch
            self._skipper.leave_out_step()
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.write(trainer, report)
        if self.action == "warn":
            # a fault that repeats is said once; each is counted in TensorBoard and the summary
            warn_once(format_report(report) + (" The optimizer step was skipped on the device (decide='device')."
                                               if late else " The optimizer step was skipped."),
                      key=("nan", report.origin.phase, report.origin.module), stacklevel=2)
        elif self.action == "stop":
            trainer.should_stop = True

    def collapsed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport) -> None:
        """A GradScaler's collapse (reported once): the scaler already skips its steps; raise, stop or warn."""
        report = self._kept(trainer, pl_module, report, self.action in ("skip", "warn"))
        self.write(trainer, report)
        if self.action == "raise":
            raise NonFiniteError(report, reason="The GradScaler's scale collapsed.")
        if self.action == "stop":
            trainer.should_stop = True
        else:
            warn_once(format_report(report), key=("nan", "scaler", report.origin.module), stacklevel=3)

    def _kept(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport,
              goes_on: bool) -> NaNReport:
        """The report amended (what loss scaling cannot do; the repair made, or a pin that did not hold), kept."""
        path, cause = report.origin.module, report.cause
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None and report.kind == "non_finite"
        repair = None
        if path and cause is not None and path not in self.repairs.pinned and self.repair and goes_on and \
                cause.cause == "precision":
            repair = self.repairs.pin(pl_module, path, pinner(trainer))
            facts_of(trainer).repairs[path] = "fp32"
        report = amended(dataclasses.replace(report, action=self.action), scaler=scaler,
                         pinned_before=bool(path) and path in self.repairs.pinned and repair is None, repair=repair)
        self.reports.append(report)
        return report

    def repairs_line(self) -> str | None:
        """The run summary's line on the modules pinned, if any."""
        if not self.repairs.pinned:
            return None
        return "  repaired (pinned to fp32 after a precision fault, repair=True): " + ", ".join(
            f"{path} at step {next((r.step for r in self.reports if r.repair and r.repair.startswith(path)), '-')}"
            for path in self.repairs.pinned)

    def state_dict(self) -> dict[str, Any]:
        """The reports (as dicts), the skip counters and the pins."""
        return {"events": [r.as_dict() for r in self.reports], "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "repairs": dict(self.repairs.pinned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict` (pins are applied again at the fit's start)."""
        self.reports = [NaNReport.from_dict(e) for e in state.get("events", [])]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.repairs.pinned = dict(state.get("repairs", {}))
