"""Trials: the contender tables timed on the first real training steps, round robin, and the fastest kept.

The whole-step candidates run on the first rows of a batch, where the activations fit in cache: there a table that
casts between classes looks cheaper than it is on the full batch (on the GPT-2-style LM of the benchmarks one row put
such a table within 7% of the fastest; the full batch, 36% behind). So the contenders (within tolerance, and close
to the fastest on those rows) are confirmed on the next real training steps: each runs a step in turn, in the order
A B C C B A (drift hits them alike), and the table with the fastest step trains on: the best of each contender's
steps, since a table's first step on the full batch pays one-off costs (kernels and buffers for new shapes and
dtypes; one such step measured twice its table's speed on the LM). These steps train as any other: the trial costs
only the slower contenders' extra time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_opkit.precision.decide import TIE

__all__ = ["Trials"]



@dataclass
class Trials:
    """The trial schedule and its step times; a pure function of the contenders and the samples given.

    Args:
        names: the contender tables, the sub-batch choice first.
        rounds: how many steps each contender runs.

    Example:
        >>> trials = Trials(["a", "b"], rounds=2)
        >>> trials.order
        ['a', 'b', 'b', 'a']
        >>> for name, ms in zip(trials.order, [10.0, 8.0, 8.2, 10.4]):
        ...     trials.add(name, ms)
        >>> trials.done, trials.winner()
        (True, 'b')
    """

    names: list[str]
    rounds: int = 2
    samples: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.samples = {n: [] for n in self.names}

    @property
    def order(self) -> list[str]:
        """Every trial step's contender, in order."""
        return [n for r in range(self.rounds) for n in (self.names if r % 2 == 0 else self.names[::-1])]

    @property
    def taken(self) -> int:
        """How many trial steps were timed."""
        return sum(len(v) for v in self.samples.values())

    @property
    def done(self) -> bool:
        """Whether every trial step was timed."""
        return self.taken >= len(self.order)

    def next(self) -> str:
        """The contender for the next trial step."""
        return self.order[self.taken]

    def add(self, name: str, ms: float) -> None:
        """One timed step of ``name``."""
        self.samples[name].append(ms)

    def best(self) -> dict[str, float]:
        """The fastest step of each contender (ms)."""
        return {n: min(v) for n, v in self.samples.items() if v}

    def winner(self) -> str:
        """The fastest contender; within :data:`TIE` of it, the earliest (the sub-batch choice first)."""
        best = self.best()
        fastest = min(best.values())
        return next(n for n in self.names if n in best and best[n] <= (1 + TIE) * fastest)

    def describe(self) -> str:
        """``"gemm+keep 1190.2 ms, per-class+keep 1220.5 ms (best of 2 training steps each)"``."""
        best = self.best()
        return ", ".join(f"{n} {best[n]:.1f} ms" for n in self.names if n in best) + (
            f" (best of {self.rounds} training steps each)")
