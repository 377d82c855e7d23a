"""Choose each op class's dtype from measurements: the fastest 16-bit dtype that is faster and accurate enough."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lightning_opkit.core.checks import check_fraction
from lightning_opkit.core.facts import FASTER
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.results import Measurement, speed_phrase

__all__ = ["DEFAULT_TOLERANCE", "MIN_SPEEDUP", "TIE", "Decision", "decide"]

#: the largest relative loss change, and the largest ``1 - cosine`` of the gradients, a lowered class may cause
DEFAULT_TOLERANCE = 0.01
#: a 16-bit dtype must be at least this much faster than fp32: the kit's one bar (core/facts.FASTER)
MIN_SPEEDUP = FASTER
#: timings within this fraction of the fastest are a tie (run-to-run noise): the candidate closest to fp32 (or the one
#: chosen on the measured rows) wins it
TIE = 0.02
#: and save at least this share of the measured op time: no precision risk for a gain nobody would notice
MIN_SAVING = 0.01


@dataclass(frozen=True)
class Decision:
    """The dtype chosen for one op class, and the evidence in words."""

    op_class: str
    dtype: str
    reason: str


def _verdict(row: Measurement, tolerance: float, min_speedup: float, total_ms: float,
             require_errors: bool = True) -> str | None:
    """Why ``row``'s dtype cannot be chosen, or ``None`` if it can."""
    if row.failed:
        return f"{row.dtype} failed ({row.failed})"
    if row.time_ratio is None:
        return f"{row.dtype} speed not measured"
    if row.time_ratio * min_speedup > 1:
        return f"{row.dtype} is {speed_phrase(row)} (needs {min_speedup:.2f}x faster)"
    if row.fp32_ms is not None and total_ms > 0 and row.fp32_ms * (1 - row.time_ratio) < MIN_SAVING * total_ms:
        saved = row.fp32_ms * (1 - row.time_ratio)
        return (f"{row.dtype} is {speed_phrase(row)} but would save {saved:.3f} of {total_ms:.2f} ms per step"
                f" (< {MIN_SAVING:.0%})")
    if row.loss_change is None or row.grad_cosine is None:
        return f"{row.dtype} error not measured" if require_errors else None
    if row.loss_change > tolerance:
        return f"{row.dtype} changes the loss by {row.loss_change:.2e} > tolerance {tolerance:g}"
    if 1 - row.grad_cosine > tolerance:
        return f"{row.dtype} gradient cosine {row.grad_cosine:.5f} < 1 - tolerance"
    return None


def decide(
    measurements: Iterable[Measurement],
    tolerance: float = DEFAULT_TOLERANCE,
    dtypes: Sequence[str] = ("bf16", "fp16"),
    min_speedup: float = MIN_SPEEDUP,
    require_errors: bool = True,
) -> dict[str, Decision]:
    """Choose per measured op class the fastest of ``dtypes`` that is fast and accurate enough, else fp32.

    A candidate must be at least ``min_speedup`` times faster than fp32, save at least 1% of the measured op time
    (where rows carry ``fp32_ms``), and stay within ``tolerance`` (relative loss change and ``1 -`` gradient cosine).

    Args:
        measurements: :class:`Measurement` rows (what :func:`measure_precision` returned, or rows built by hand).
        tolerance: the largest relative loss change and the largest ``1 - grad cosine`` allowed.
        dtypes: the candidate dtypes (fp16 only where loss scaling is on).
        min_speedup: how much faster than fp32 a candidate must be.
        require_errors: refuse a dtype whose error was not measured; ``False``: judge speed alone where no error
            was measured (the whole-step tables are then judged on error as a whole).

    Example:
        >>> rows = [Measurement("matmul", "bf16", time_ratio=11.2, loss_change=1e-3, grad_cosine=0.9999),
        ...         Measurement("conv", "bf16", time_ratio=0.4, loss_change=1e-3, grad_cosine=0.9999)]
        >>> {c: d.dtype for c, d in decide(rows).items()}
        {'matmul': 'fp32', 'conv': 'bf16'}
    """
    check_fraction("tolerance", tolerance)
    by_class: dict[str, list[Measurement]] = {}
    for row in measurements:
        by_class.setdefault(row.op_class, []).append(row)
    total_ms = sum(next((r.fp32_ms for r in rows if r.fp32_ms is not None), 0.0) for rows in by_class.values())
    decisions: dict[str, Decision] = {}
    for cls in sorted(by_class, key=lambda c: OP_CLASSES.index(c) if c in OP_CLASSES else len(OP_CLASSES)):
        rows = [r for r in by_class[cls] if r.dtype in dtypes]
        refused = {r.dtype: _verdict(r, tolerance, min_speedup, total_ms, require_errors) for r in rows}
        good = [r for r in rows if refused[r.dtype] is None]
        if good:
            best = min(good, key=lambda r: r.time_ratio)  # type: ignore[arg-type, return-value]
            reason = f"{speed_phrase(best)} than fp32"
            if best.loss_change is not None and best.grad_cosine is not None:
                reason += f", loss change {best.loss_change:.2e}, grad cosine {best.grad_cosine:.5f}"
            others = [text for d, text in refused.items() if text is not None]
            decisions[cls] = Decision(cls, best.dtype, reason + (f"; not {'; '.join(others)}" if others else ""))
        else:
            why = "; ".join(text for text in refused.values() if text) or "no 16-bit dtype measured"
            decisions[cls] = Decision(cls, "fp32", why)
    return decisions
