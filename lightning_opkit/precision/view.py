"""What PrecisionPolicy shows: the policy table, the census in TensorBoard, and its lines of the run summary."""

from __future__ import annotations

from typing import Any

from lightning_opkit.core.facts import Fp8Fact, RunFacts, SpeedFact
from lightning_opkit.core.logging import LogWriter, markdown_table
from lightning_opkit.core.warn import warn_once
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.census import CensusRow, census_markdown, merge_rows, near_overflow
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import GOVERNED
from lightning_opkit.precision.fp8_measure import Fp8Measurements, Fp8Row
from lightning_opkit.precision.governor import ASIDE, AUTOCAST_LOWERS
from lightning_opkit.precision.results import PrecisionMeasurements
from lightning_opkit.precision.speed_check import lowered

__all__ = ["ASIDE", "CHARTS", "fp8_fact", "policy_markdown", "record_facts", "summary_lines", "write_census"]

#: the policy's TensorBoard charts: census error, underflow, fp16 headroom, calls, and what measuring cost
CHARTS: dict[str, list[Any]] = {
    "16-bit output error vs fp32 recompute (relative)": ["Multiline", [r"opkit/precision/[a-z]+/rel_error"]],
    "16-bit outputs lost to underflow (fraction)": ["Multiline", [r"opkit/precision/[a-z]+/underflow_frac"]],
    "fp16 headroom to overflow (bits)": ["Multiline", [r"opkit/precision/[a-z]+/headroom_bits"]],
    "calls per census step": ["Multiline", [r"opkit/precision/[a-z]+/calls"]],
    "measurement time (s)": ["Multiline", [r"opkit/precision/measure_s"]],
}



def policy_markdown(table: dict[str, str], decisions: dict[str, Decision], overrides: dict[str, str],
                    waiting: bool) -> str:
    """``opkit/precision/policy``: each class's dtype and why, then the module overrides.

    Args:
        table: op class -> dtype name.
        decisions: ``rules="auto"``'s decisions, by class.
        overrides: the module overrides.
        waiting: ``rules="auto"`` before its measurement.

    Example:
        >>> print(policy_markdown({c: "fp32" for c in OP_CLASSES}, {}, {}, waiting=False).splitlines()[2])
        | matmul | fp32 | - |
    """
    rows = [[cls, table[cls], decisions[cls].reason if cls in decisions else "-"] for cls in OP_CLASSES]
    rows += [[f"module {k}", v, "module override"] for k, v in overrides.items()]
    text = markdown_table(["op class / module", "dtype", "why"], rows)
    if waiting:
        text = "rules='auto': every class in fp32 until measured at the first training batch.\n\n" + text
    return text


def write_speed_check(writer: LogWriter | None, measured: PrecisionMeasurements | None, table: dict[str, str],
                      step: int) -> None:
    """Write the explicit rules' speed check (``opkit/precision/sensitivity``): each lowered class against fp32.

    Args:
        writer: the policy's writer (``None``: nothing written).
        measured: the speed check's measurements (``None``: nothing was timed).
        table: op class -> dtype name.
        step: the global step.
    """
    if writer is not None and measured is not None:
        writer.text("opkit/precision/sensitivity", measured.table({c: table[c] for c in lowered(table)}), step)


def write_census(writer: LogWriter | None, rows: list[CensusRow], table: dict[str, str], step: int) -> None:
    """Warn about fp16 classes near overflow (rank zero); write the census scalars and table.

    Args:
        writer: the policy's writer (``None``: warnings only).
        rows: the census rows.
        table: op class -> dtype name.
        step: the global step.
    """
    for r in near_overflow(rows):
        warn_once(f"PrecisionPolicy: op class {r.op_class!r} in fp16 is {r.headroom_bits:.1f} bits from"
                  f" overflow at step {step} (max |output| near finfo(fp16).max); consider running it in"
                  f" 'fp32' or 'bf16'.", key=("precision", "fp16 headroom", r.op_class))
    if writer is None:
        return
    for cls, figures in merge_rows(rows, lambda r: r.op_class).items():
        writer.scalars(f"opkit/precision/{cls}", {name: figures[name] for name in (
            "calls", "rel_error", "underflow_frac", "headroom_bits")}, step)
    writer.text("opkit/precision/census", census_markdown(rows, table), step)
    writer.flush()


def summary_lines(table: dict[str, str], decisions: dict[str, Decision], overrides: dict[str, str],
                  autocast: str | None, aside: str, auto: Any | None) -> list[str]:
    """The policy's lines of the run summary.

    Args:
        table: op class -> dtype name.
        decisions: ``rules="auto"``'s decisions.
        overrides: the module overrides.
        autocast: plain autocast's dtype, when ``rules="auto"`` chose it.
        aside: why the policy's mode stands aside on most steps (:meth:`StepGovernor.aside`), or empty.
        auto: the :class:`~lightning_opkit.precision.auto.AutoPrecision` under ``rules="auto"``, else ``None``.
    """
    by_dtype: dict[str, list[str]] = {}
    for cls in GOVERNED:
        if not decisions or cls in decisions:  # under auto: the classes the model ran
            by_dtype.setdefault(table[cls], []).append(cls)
    head = "precision policy"
    if auto is not None and auto.measurements is not None:
        head += f" (auto, measured in {auto.measure_seconds:.1f} s on {auto.measurements.device})"
    lines = [head + ": " + "; ".join(f"{', '.join(v)} {'keep' if k == 'keep' else 'in ' + k}"
                                     for k, v in by_dtype.items())]
    if autocast is not None:
        lines[0] = (f"{head}: plain torch.autocast in {autocast} (what bf16-mixed runs), the fastest within"
                    f" tolerance here; the policy's mode stands aside")
    if auto is not None and auto.choice is not None:
        lines.append(f"  {auto.choice.comparison()}")
    if overrides:
        lines.append("  module overrides: " + ", ".join(f"{k} -> {v}" for k, v in overrides.items()))
    if aside:
        lines.append(f"  {aside}")
    return lines


def record_facts(facts: RunFacts, table: dict[str, str], decisions: dict[str, Decision],
                 measured: PrecisionMeasurements | None, source: str, fp8: Fp8Measurements | None = None,
                 autocast: str | None = None) -> None:
    """Tell the kit what runs in which dtype, what was measured (and by whom), and why a class stays in fp32.

    Args:
        facts: the run's facts.
        table: op class -> dtype name.
        decisions: ``rules="auto"``'s decisions, by class.
        measured: the last measurements, if any.
        source: who measured, and when (``"PrecisionPolicy(rules='auto') at step 0"``).
        fp8: ``rules="auto"``'s float8 measurement per Linear, if one ran.
        autocast: the dtype of plain ``torch.autocast``, where the policy runs that: the classes autocast lowers run
            in it (the table says ``keep`` for them, which is no dtype a reader of the facts can act on).
    """
    ran = {c: autocast if autocast is not None and d == "keep" and c in AUTOCAST_LOWERS else d
           for c, d in table.items()}
    facts.dtypes = {c: d for c, d in ran.items() if c in GOVERNED and d != "keep"}
    facts.kept_fp32 = {c: (decisions[c].reason if c in decisions else "set to fp32 by its rules")
                       for c, d in facts.dtypes.items() if d == "fp32"}
    for row in measured or []:
        if row.time_ratio is not None and not row.failed:
            facts.speeds[(row.op_class, row.dtype)] = SpeedFact(
                row.op_class, row.dtype, row.time_ratio, "this model's ops at the shapes of its first training"
                " step, forward + backward, input casts included", source)
    facts.fp8 = fp8_fact(fp8, source) if fp8 is not None else None


def fp8_fact(fp8: Fp8Measurements, source: str) -> Fp8Fact | None:
    """The kit's fact of a float8 measurement: every timed Linear together, and the chosen ones (``None``: none timed).

    Args:
        fp8: the measurement.
        source: who measured, and when.
    """
    timed = [r for r in fp8.rows if r.base_ms is not None and r.fp8_ms is not None]
    if not timed:
        return None

    def together(rows: list[Fp8Row]) -> SpeedFact:
        ratio = sum(r.fp8_ms or 0.0 for r in rows) / max(sum(r.base_ms or 0.0 for r in rows), 1e-12)
        return SpeedFact("matmul", "fp8", ratio, f"{len(rows)} Linears' GEMMs at this run's rows", source,
                         baseline=rows[0].base, passes="forward and backward")

    chosen = [r for r in timed if r.chosen]
    return Fp8Fact(together(timed), tuple(r.module for r in chosen), len(timed), together(chosen) if chosen else None)
