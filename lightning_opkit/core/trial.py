"""A timed trial: alternatives run in turn on real calls (training steps, a region's forwards), after a warm-up.

The one way the kit times alternatives on the user's own work: PrecisionPolicy's contender tables, TorchCompile's
eager against compiled, ActivationCheckpointing's steps with and without. Each round reverses the order of the last
(A B B A A B ...), so a drift in the machine's speed (clocks warming, a neighbour's load) hits every arm alike; each
call is timed on the device's clock (:class:`~lightning_opkit.core.timing.StepClock`: CUDA events read once at the
end, the host clock elsewhere), so a timed call never waits for the GPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from lightning_opkit.core.timing import StepClock

__all__ = ["WARMUP", "Trial"]

#: what :meth:`Trial.next` answers for a warm-up call
WARMUP = "warmup"


class Trial:
    """The schedule of a timed trial and its samples; every figure is read from the recorded times.

    Args:
        arms: the alternatives, in order (the first is kept in a tie).
        rounds: how many timed calls each arm gets.
        warmup: calls before the first timed one (a compile, first-shape allocations): answered ``"warmup"``.

    Example:
        >>> trial = Trial(["a", "b"], rounds=2, warmup=1)
        >>> [trial.next() for _ in range(6)]
        ['warmup', 'a', 'b', 'b', 'a', None]
        >>> for arm, s in [("a", 0.010), ("b", 0.008), ("b", 0.0082), ("a", 0.0104)]:
        ...     trial.add(arm, s)
        >>> trial.winner(tie=0.02), round(trial.ratio("a", "b"), 3)
        ('b', 1.259)
    """

    def __init__(self, arms: Sequence[str], rounds: int, warmup: int = 0) -> None:
        self.arms, self.rounds, self.warmup = list(arms), rounds, warmup
        #: calls answered so far (warm-up ones included)
        self.calls = 0
        self._clocks = {arm: StepClock() for arm in self.arms}
        self._given: dict[str, list[float]] = {arm: [] for arm in self.arms}
        self._timing: str | None = None

    @property
    def order(self) -> list[str]:
        """Every timed call's arm, in order."""
        return [a for r in range(self.rounds) for a in (self.arms if r % 2 == 0 else self.arms[::-1])]

    def next(self) -> str | None:
        """What the next call runs: ``"warmup"``, an arm, or ``None`` once every timed call was handed out."""
        i = self.calls - self.warmup
        if i >= len(self.order):
            return None
        self.calls += 1
        return WARMUP if i < 0 else self.order[i]

    @property
    def done(self) -> bool:
        """Whether every timed call was handed out (and, for the one in flight, stopped)."""
        return self.calls >= self.warmup + len(self.order) and self._timing is None

    def start(self, arm: str, device: torch.device | str) -> None:
        """A timed call of ``arm`` begins on ``device``."""
        self._timing = arm
        self._clocks[arm].start(device)

    def stop(self, keep: bool = True) -> None:
        """The timed call ends; a call that did not run as the arm should (it failed, say) is not ``keep``-t."""
        arm, self._timing = self._timing, None
        if arm is not None:
            self._clocks[arm].stop(keep)

    def add(self, arm: str, seconds: float) -> None:
        """A call of ``arm`` timed elsewhere (a figure recorded before, a test's)."""
        self._given[arm].append(seconds)

    def seconds(self, arm: str) -> list[float]:
        """Every timed call of ``arm`` (seconds; on CUDA this waits for the calls' events)."""
        return self._given[arm] + self._clocks[arm].seconds(wait=True)

    def median(self, arm: str) -> float:
        """The median call of ``arm`` (seconds)."""
        return statistics.median(self.seconds(arm))

    def best(self) -> dict[str, float]:
        """The fastest call of each arm that has one (seconds)."""
        return {arm: min(s) for arm in self.arms if (s := self.seconds(arm))}

    def ratio(self, slow: str, fast: str) -> float:
        """``slow``'s median over ``fast``'s (1.0 when either has no sample: nothing to decide on)."""
        a, b = self.seconds(slow), self.seconds(fast)
        if not (a and b):
            return 1.0
        return statistics.median(a) / max(statistics.median(b), 1e-12)

    def winner(self, tie: float) -> str:
        """The arm with the fastest call; within ``tie`` (a fraction) of it, the earliest arm."""
        best = self.best()
        fastest = min(best.values())
        return next(a for a in self.arms if a in best and best[a] <= (1 + tie) * fastest)
