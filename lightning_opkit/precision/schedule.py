"""When PrecisionPolicy measures, trials, takes a census or a speed check, Trainer-free.

It measures at the first batch and again every N steps, once per optimizer step (:class:`MeasureSchedule`); around
each batch :class:`PolicySteps` says what the policy runs and does: a trial's contender, a checkpoint's plan, a
measurement, a census step, a speed check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_opkit.precision.auto import AutoPrecision
from lightning_opkit.precision.governor import StepGovernor
from lightning_opkit.precision.oplog import OpLog
from lightning_opkit.precision.plan import Plan
from lightning_opkit.precision.results import PrecisionMeasurements
from lightning_opkit.precision.speed_check import check_speed

__all__ = ["BatchEnd", "BatchStart", "MeasureSchedule", "PolicySteps"]


class MeasureSchedule:
    """What the policy does at a batch before its step runs: run a checkpoint's plan, measure, speed-check, or nothing.

    Under ``rules="auto"`` the first batch measures and decides (a resumed fit runs the plan its checkpoint brought
    instead), and every ``every`` optimizer steps it measures again; with explicit rules and ``measure``, the first
    batch's own step is recorded for the speed check. A step measures once, whatever its gradient accumulation.

    Args:
        auto: ``rules="auto"``.
        measure: explicit rules are speed-checked once.
        every: ``remeasure_every_n_steps`` (0: never again).

    Example:
        >>> schedule = MeasureSchedule(auto=True, measure=True, every=4)
        >>> [schedule.at(step) for step in (0, 0, 1, 4)]
        ['measure', None, None, 'measure']
    """

    def __init__(self, auto: bool, measure: bool, every: int) -> None:
        self.auto, self.measure, self.every = auto, measure, every
        #: the step measured last (``None``: not yet in this fit)
        self.measured_at: int | None = None
        #: a plan a checkpoint brought, run at the first batch instead of measuring
        self.restored: Any = None

    def start(self) -> None:
        """A new fit: nothing measured in it yet (a checkpoint's plan, loaded after this, is kept)."""
        self.measured_at = None

    def at(self, step: int) -> str | None:
        """``"restore"``, ``"measure"``, ``"speed check"`` or ``None`` at the batch of optimizer step ``step``."""
        if self.measured_at == step:
            return None  # gradient accumulation: one measurement per optimizer step
        first = self.measured_at is None
        if self.auto and first and self.restored is not None:
            self.measured_at = step
            return "restore"
        if self.auto and (first or (self.every and step % self.every == 0)):
            self.measured_at = step
            return "measure"
        if not self.auto and self.measure and first:
            self.measured_at = step
            return "speed check"
        return None

    def take_restored(self) -> Any:
        """The checkpoint's plan, once."""
        plan, self.restored = self.restored, None
        return plan


@dataclass(frozen=True)
class BatchStart:
    """What a batch's start asks of the policy, in this order.

    Args:
        trial: the contender table this trial step runs (``rules="auto"`` confirming its choice on real steps).
        restore: the plan a resumed fit's checkpoint brought, run from this batch on.
        measure: measure and decide on this batch (``rules="auto"``).
    """

    trial: Plan | None = None
    restore: Plan | None = None
    measure: bool = False


@dataclass(frozen=True)
class BatchEnd:
    """What a batch's end hands the policy.

    Args:
        plan: the trial's winner, when the last contender has had its steps.
        speed: the speed check of explicit rules, timed on the ops this batch's step ran.
        census: this batch's census rows, where it was a census step.
    """

    plan: Plan | None = None
    speed: PrecisionMeasurements | None = None
    census: list[Any] | None = None


_NOTHING_STARTS, _NOTHING_ENDS = BatchStart(), BatchEnd()


class PolicySteps:
    """Which training steps the policy measures, trials, takes a census on or speed-checks, Trainer-free.

    The policy asks at each batch's start and end and applies what it is handed: this class decides *when*, the
    parts it holds decide *how* (:class:`MeasureSchedule` when to measure, :class:`~.auto.AutoPrecision` the trial's
    contenders and winner, :class:`~.governor.StepGovernor` a census or a recorded step). A census step recomputes every
    op in fp32, so it is no sample for a trial, nor is a step another callback times its own alternatives on.

    Args:
        auto: the policy's ``rules="auto"`` part (measurements and trials).
        schedule: when it measures.
        governor: how each step runs (it takes the census and records the speed check's step).

    Example:
        >>> from lightning_opkit.precision.auto import AutoPrecision
        >>> from lightning_opkit.precision.governor import StepGovernor
        >>> steps = PolicySteps(AutoPrecision(0.01, True, 2), MeasureSchedule(True, True, 0), StepGovernor({}))
        >>> start = steps.start(0, torch.device("cpu"), True, bool, list)
        >>> start.measure, steps.governor.census_step
        (True, True)
    """

    def __init__(self, auto: AutoPrecision, schedule: MeasureSchedule, governor: StepGovernor) -> None:
        self.auto, self.schedule, self.governor = auto, schedule, governor

    def start(self, step: int, device: torch.device, census: bool, others_timing: Callable[[], bool],
              lowered: Callable[[], list[str]]) -> BatchStart:
        """At the batch of optimizer step ``step``: what the policy runs and does before the step.

        Args:
            step: the optimizer step the batch belongs to.
            device: the model's device (a trial times its step on it).
            census: this step takes a census (the policy's ``census_every_n_steps``, read as it is now).
            others_timing: whether another callback times its own alternatives on the fit's steps now; asked only
                on a trial step (this runs at every batch).
            lowered: the classes the table runs in 16-bit (explicit rules with none are not speed-checked); asked
                only on the speed check's batch.
        """
        self.governor.census_step = census
        trial_step = self.auto.trialing and self.schedule.measured_at != step
        what = self.schedule.at(step)
        if what is None and not trial_step:
            return _NOTHING_STARTS  # most batches, once decided (this runs at every one)
        if what == "speed check" and lowered():
            self.governor.speed_log = OpLog()  # filled by this batch's own training step, timed at its end
        return BatchStart(trial=self.auto.begin_trial_step(device, census or others_timing()) if trial_step else None,
                          restore=self.schedule.take_restored() if what == "restore" else None,
                          measure=what == "measure")

    @property
    def ends_idle(self) -> bool:
        """Whether a batch's end has nothing to hand over (no trial, speed check or census): most batches."""
        governor = self.governor
        return self.auto.idle and governor.recorded is None and governor.census_done is None

    def end(self, device: torch.device, agree: Callable[[Any], Any], table: dict[str, str]) -> BatchEnd:
        """At the batch's end: a trial's winner, the speed check of the recorded step, the census's rows.

        Args:
            device: the model's device.
            agree: rank zero's value on every rank (a trial's winner must be the same everywhere).
            table: the class table in force (what the speed check times against fp32).
        """
        governor = self.governor
        if self.ends_idle:
            return _NOTHING_ENDS  # most batches (this runs at every one)
        plan = self.auto.end_trial_step(device, agree)
        log, census, governor.recorded, governor.census_done = governor.recorded, governor.census_done, None, None
        return BatchEnd(plan, check_speed(log, device, table) if log is not None else None,
                        census.rows() if census is not None else None)
