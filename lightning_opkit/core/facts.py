"""What this run measured, recorded once and read by every callback: the kit's shared facts.

A precision policy records each op class's 16-bit speed at this model's shapes (and why it kept a class in fp32);
TorchCompile its regions and whether each runs compiled or eager; NaNDetector the repairs it made. The roofline reads
them: a lever rests on one of these measurements, named with its value, shapes and source, and none contradicts one.
Trainer-free: a :class:`RunFacts` per fit, found for a Trainer through :func:`facts_of`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from lightning_opkit.core.text import times_phrase

__all__ = ["CLEARLY_SLOWER", "FASTER", "Fp8Fact", "RunFacts", "SpeedFact", "facts_of", "new_facts"]

#: a measured alternative counts as faster only at least this much faster (timings on a busy machine vary by a few
#: percent): the bar of the precision policy's decision and of every lever that rests on a speed fact
FASTER = 1.05
#: a timing loop may stop early for a variant this many times slower than the first: no noise turns that around
CLEARLY_SLOWER = 3.0


@dataclass(frozen=True)
class SpeedFact:
    """One op class run one way against another, timed at this model's shapes: a dtype against fp32, a layout.

    Args:
        op_class: the op class.
        candidate: what was tried: ``"bf16"``, ``"fp16"``, ``"channels_last"``.
        ratio: time with ``candidate`` over time with ``baseline`` (below 1: faster).
        shapes: which shapes were timed, in words.
        source: who measured it, and when.
        baseline: what it was timed against (``"fp32"``, ``"contiguous"``).
        current: what the model runs in now, where that is not ``baseline`` by default (a layout).
        passes: which passes were timed, in words, for the phrase (``"forward and backward"``); empty: unsaid.
    """

    op_class: str
    candidate: str
    ratio: float
    shapes: str
    source: str
    baseline: str = "fp32"
    current: str | None = None
    passes: str = ""

    @property
    def dtype(self) -> str:
        """The candidate, named as a dtype (the precision facts')."""
        return self.candidate

    @property
    def faster(self) -> bool:
        """Whether the candidate measured faster than the baseline."""
        return self.ratio < 1

    def phrase(self) -> str:
        """``"bf16 measured 2.17x slower than fp32 at ... (source)"``.

        Example:
            >>> SpeedFact("matmul", "bf16", 0.5, "3 GEMM shapes", "the roofline, window 1").phrase()
            'bf16 measured 2.00x faster than fp32 at 3 GEMM shapes (the roofline, window 1)'
            >>> SpeedFact("conv", "channels_last", 0.5, "2 shapes", "window 1", baseline="contiguous",
            ...           current="contiguous", passes="forward and backward").phrase()
            'channels_last measured 2.00x faster than contiguous (forward and backward) at 2 shapes (window 1)'
        """
        passes = f" ({self.passes})" if self.passes else ""
        return (f"{self.candidate} measured {times_phrase(self.ratio)} than {self.baseline}{passes} at {self.shapes}"
                f" ({self.source})")


@dataclass(frozen=True)
class Fp8Fact:
    """Linears timed in float8 against their class's dtype, and those that run in float8 by that measurement.

    Args:
        speed: every timed Linear's GEMMs together: float8's time over the class dtype's.
        chosen: the Linears that run in float8.
        timed: how many were timed.
        chosen_speed: the chosen ones' together (``None``: none chosen).
    """

    speed: SpeedFact
    chosen: tuple[str, ...]
    timed: int
    chosen_speed: SpeedFact | None = None

    def phrase(self) -> str:
        """``"float8 ran 4 of 6 timed Linears (fp8 measured 1.41x faster than bf16 ... on those)"``."""
        if self.chosen_speed is None:
            return f"{self.speed.phrase()}: no float8 lever here"
        return f"float8 runs {len(self.chosen)} of {self.timed} timed Linears ({self.chosen_speed.phrase()})"


@dataclass
class RunFacts:
    """The measurements and actions of one fit that more than one callback reads.

    ``speeds``: (op class, dtype) -> :class:`SpeedFact`. ``kept_fp32``: op class -> why a policy measured and kept it
    in fp32. ``dtypes``: op class -> the dtype a policy runs it in. ``compiled``: the compiled regions;
    ``eager_regions``: those running eagerly because compiled measured slower (region -> eager / compiled time).
    ``repairs``: module path -> dtype it was pinned to after a precision fault. ``peaks``: the measured peaks.
    ``checkpointed``: block path -> the op classes whose outputs its activation checkpoint keeps (empty: full).
    ``layouts``: op class -> a :class:`SpeedFact` of its channels_last time against contiguous. ``fp8``: the
    Linears' GEMMs timed in float8 against their class's dtype (``rules="auto"``), and how many run in float8.
    """

    speeds: dict[tuple[str, str], SpeedFact] = field(default_factory=dict)
    kept_fp32: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)
    eager_regions: dict[str, float] = field(default_factory=dict)
    repairs: dict[str, str] = field(default_factory=dict)
    checkpointed: dict[str, list[str]] = field(default_factory=dict)
    layouts: dict[str, SpeedFact] = field(default_factory=dict)
    fp8: Fp8Fact | None = None
    peaks: Any = None

    def speed(self, op_class: str) -> SpeedFact | None:
        """The fastest 16-bit measurement of ``op_class`` (``None``: not measured in this run)."""
        found = [f for (c, _), f in self.speeds.items() if c == op_class]
        return min(found, key=lambda f: f.ratio, default=None)


_FACTS: weakref.WeakKeyDictionary[Any, RunFacts] = weakref.WeakKeyDictionary()


def facts_of(trainer: Any) -> RunFacts:
    """The facts of ``trainer``'s current fit (made empty on first use).

    Example:
        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
        >>> facts_of(trainer) is facts_of(trainer), facts_of(trainer).speeds
        (True, {})
    """
    if trainer not in _FACTS:
        _FACTS[trainer] = RunFacts()
    return _FACTS[trainer]


def new_facts(trainer: Any) -> RunFacts:
    """Start ``trainer``'s facts afresh (a new fit measures anew)."""
    _FACTS[trainer] = RunFacts()
    return _FACTS[trainer]
