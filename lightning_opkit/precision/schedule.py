"""When PrecisionPolicy measures, Trainer-free: at the first batch, again every N steps, once per optimizer step."""

from __future__ import annotations

from typing import Any

__all__ = ["MeasureSchedule"]


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
