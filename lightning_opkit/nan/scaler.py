"""A GradScaler's collapse: steps it skipped in a row while its scale fell by 2^10 or more, reported once.

Under fp16 mixed precision a GradScaler skips a step whose gradients overflowed and halves its scale; now and then
that is loss scaling at work. When the steps it skips come one after another and the scale keeps falling, gradients
overflow fp16 whatever the scale: training stalls, and the scaler says nothing. NaNDetector says it once, with the
module where the gradients first went non-finite.
"""

from __future__ import annotations

from lightning_opkit.nan.report import Cause

__all__ = ["COLLAPSE", "ScaleWatch", "collapse_cause"]

#: the fall of the scale, over steps skipped in a row, that counts as a collapse
COLLAPSE = 2.0**10


class ScaleWatch:
    """Counts the steps a GradScaler skipped in a row and how far its scale fell over them.

    Example:
        >>> watch = ScaleWatch()
        >>> [watch.skipped_step(2.0**16 / 2**i) for i in range(11)][-2:]
        [False, True]
        >>> watch.describe(64.0)
        "the GradScaler's scale fell from 65536 to 64 over 11 steps it skipped in a row"
    """

    def __init__(self) -> None:
        self.first: float | None = None
        self.skipped = 0
        #: a collapse was reported in this run (once is enough: the report names the module)
        self.reported = False

    def healthy(self) -> None:
        """A step went through: the run of skipped steps is over."""
        self.first, self.skipped = None, 0

    def skipped_step(self, scale: float) -> bool:
        """The scaler skipped a step at ``scale``; whether that makes a collapse to report (once)."""
        self.first = scale if self.first is None else self.first
        self.skipped += 1
        if self.reported or scale > self.first / COLLAPSE:
            return False
        self.reported = True
        return True

    def describe(self, scale: float) -> str:
        """The collapse in words."""
        return (f"the GradScaler's scale fell from {self.first:g} to {scale:g} over {self.skipped} steps it skipped"
                " in a row")


def collapse_cause(collapse: str, module: str | None) -> Cause:
    """The cause of a collapse: loss scaling cannot fix it; where the gradients first overflowed, and what to try.

    Args:
        collapse: :meth:`ScaleWatch.describe`'s words.
        module: the module whose gradients first went non-finite at that scale, if a replay named one.

    Example:
        >>> collapse_cause("the scale fell", "fc").advice.endswith("run it in fp32 (PrecisionPolicy(overrides="
        ...                                                      "{'fc': 'fp32'})) or train in bf16")
        True
    """
    where = f"module {module!r}" if module else "a module no replay named"
    fix = f" (PrecisionPolicy(overrides={{{module!r}: 'fp32'}}))" if module else ""
    return Cause("precision", f"{collapse}: gradients overflow fp16 whatever the scale, which loss scaling cannot fix"
                              f" (training stalls: every step is skipped); the first non-finite gradient is in {where}:"
                              f" run it in fp32{fix} or train in bf16")
