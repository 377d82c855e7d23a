"""What NaNDetector writes to TensorBoard (and the Trainer's other loggers), besides its counters."""

from __future__ import annotations

from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.text import markdown_table
from lightning_opkit.nan.dead import COLUMNS, Dead
from lightning_opkit.nan.report import NaNReport, format_report

__all__ = ["write_dead", "write_report"]


def write_report(writer: LogWriter, report: NaNReport, step: int) -> None:
    """``opkit/nan/report`` (the report and its fields) and ``opkit/nan/cause``.

    Args:
        writer: the detector's writer.
        report: the report.
        step: the global step.
    """
    rows = [[key, "-" if value is None else value] for key, value in report.as_dict().items()]
    writer.text("opkit/nan/report", format_report(report) + "\n\n" + markdown_table(["field", "value"], rows), step)
    if report.cause is not None:
        writer.text("opkit/nan/cause", f"**{report.cause.cause}**: {report.cause.advice}", step)
    writer.flush()


def write_dead(writer: LogWriter, found: list[Dead], step: int) -> None:
    """``opkit/nan/dead_parameters``: every parameter and expert named so far.

    Args:
        writer: the detector's writer.
        found: what the dead-parameter watch has named.
        step: the global step.
    """
    writer.text("opkit/nan/dead_parameters", markdown_table(COLUMNS, [d.row() for d in found]), step)
    writer.flush()
