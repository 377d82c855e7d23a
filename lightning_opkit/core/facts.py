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

__all__ = ["FASTER", "LayoutFact", "RunFacts", "SpeedFact", "facts_of", "new_facts"]

#: a measured alternative counts as faster only at least this much faster (timings on a busy machine vary by a few
#: percent): the bar of the precision policy's decision and of every lever that rests on a speed fact
FASTER = 1.05


@dataclass(frozen=True)
class SpeedFact:
    """One op class in one 16-bit dtype against fp32, timed at this model's shapes.

    Args:
        op_class: the op class.
        dtype: ``"bf16"`` or ``"fp16"``.
        ratio: time in ``dtype`` over time in fp32 (below 1: faster).
        shapes: which shapes were timed, in words.
        source: who measured it, and when.
    """

    op_class: str
    dtype: str
    ratio: float
    shapes: str
    source: str

    @property
    def faster(self) -> bool:
        """Whether the 16-bit dtype measured faster than fp32."""
        return self.ratio < 1

    def phrase(self) -> str:
        """``"bf16 measured 2.17x slower than fp32 at ... (source)"``.

        Example:
            >>> SpeedFact("matmul", "bf16", 0.5, "3 GEMM shapes", "the roofline, window 1").phrase()
            'bf16 measured 2.00x faster than fp32 at 3 GEMM shapes (the roofline, window 1)'
        """
        return f"{self.dtype} measured {times_phrase(self.ratio)} than fp32 at {self.shapes} ({self.source})"


@dataclass(frozen=True)
class LayoutFact:
    """An op class's time in ``channels_last`` against contiguous, forward and backward, at this model's shapes.

    Args:
        op_class: the op class (``"conv"``).
        ratio: time in channels_last over time contiguous (below 1: channels_last is faster).
        current: the layout the model runs in now: ``"contiguous"`` or ``"channels_last"``.
        shapes: which shapes were timed, in words.
        source: who measured it, and when.
    """

    op_class: str
    ratio: float
    current: str
    shapes: str
    source: str

    def phrase(self) -> str:
        """``"channels_last measured 1.80x faster than contiguous (forward and backward) at ... (source)"``.

        Example:
            >>> LayoutFact("conv", 0.5, "contiguous", "2 shapes", "window 1").phrase()
            'channels_last measured 2.00x faster than contiguous (forward and backward) at 2 shapes (window 1)'
        """
        return (f"channels_last measured {times_phrase(self.ratio)} than contiguous (forward and backward) at"
                f" {self.shapes} ({self.source})")


@dataclass
class RunFacts:
    """The measurements and actions of one fit that more than one callback reads.

    ``speeds``: (op class, dtype) -> :class:`SpeedFact`. ``kept_fp32``: op class -> why a policy measured and kept it
    in fp32. ``dtypes``: op class -> the dtype a policy runs it in. ``compiled``: the compiled regions;
    ``eager_regions``: those running eagerly because compiled measured slower (region -> eager / compiled time).
    ``repairs``: module path -> dtype it was pinned to after a precision fault. ``peaks``: the measured peaks.
    ``checkpointed``: block path -> the op classes whose outputs its activation checkpoint keeps (empty: full).
    ``layouts``: op class -> :class:`LayoutFact`, its channels_last time against contiguous.
    """

    speeds: dict[tuple[str, str], SpeedFact] = field(default_factory=dict)
    kept_fp32: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)
    compiled: list[str] = field(default_factory=list)
    eager_regions: dict[str, float] = field(default_factory=dict)
    repairs: dict[str, str] = field(default_factory=dict)
    checkpointed: dict[str, list[str]] = field(default_factory=dict)
    layouts: dict[str, LayoutFact] = field(default_factory=dict)
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
