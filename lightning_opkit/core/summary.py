"""One run summary for all opkit callbacks of a Trainer, and one TensorBoard custom-scalars layout.

Each callback contributes lines (``summary_lines()``) and charts (``layout()``); the first opkit callback in
``trainer.callbacks`` prints the summary on rank zero when fit ends or fails, writes it as the text tag
``opkit/summary``, and at setup writes the custom-scalars layout that groups every area's charts.
"""

from __future__ import annotations

import shlex
from typing import Any

import lightning.pytorch as pl

from lightning_opkit.core.facts import new_facts
from lightning_opkit.core.kit import members
from lightning_opkit.core.logging import LogWriter
from lightning_opkit.core.warn import new_run


def is_first(trainer: pl.Trainer, callback: Any) -> bool:
    """Whether ``callback`` is the first opkit callback of ``trainer`` (the one that writes shared things)."""
    first = members(trainer)
    return bool(first) and first[0] is callback


def merged_layout(trainer: pl.Trainer) -> dict[str, dict[str, list[Any]]]:
    """The custom-scalars layout of every opkit callback of ``trainer``: each contributes its own categories.

    A chart two callbacks both contribute (the same category and title) shows every tag either names.

    Example:
        >>> merged_layout(pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False))
        {}
    """
    layout: dict[str, dict[str, list[Any]]] = {}
    for member in members(trainer):
        for category, charts in member.layout().items():
            into = layout.setdefault(category, {})
            for title, (kind, tags) in charts.items():
                known = into.setdefault(title, [kind, []])[1]
                known.extend(t for t in tags if t not in known)
    return layout


def write_layout(trainer: pl.Trainer, callback: Any, writer: LogWriter) -> None:
    """Write the custom-scalars layout once per run (by the first opkit callback, on rank zero).

    Args:
        trainer: the running trainer.
        callback: the calling opkit callback.
        writer: its writer.
    """
    if is_first(trainer, callback) and writer.active:
        writer.custom_scalars(merged_layout(trainer))


def start_summary(callback: Any, trainer: pl.Trainer, writer: LogWriter) -> None:
    """At a fit's setup: arm the summary and write the layout (first opkit callback only).

    Args:
        callback: the calling opkit callback.
        trainer: the running trainer.
        writer: its writer.
    """
    if is_first(trainer, callback):
        new_facts(trainer)  # a new fit measures anew; the first callback's setup runs before the others'
        new_run()  # and says each warning once again
    write_layout(trainer, callback, writer)


def _where(writers: list[LogWriter]) -> list[str]:
    """The summary's lines on where the run's logs are: every directory any opkit callback wrote event files to."""
    boards = list(dict.fromkeys(d for w in writers for d in w.tensorboard_dirs))
    if boards:
        return [f"  logs and traces: {', '.join(boards)}",
                *(f"  open them with:  tensorboard --logdir {shlex.quote(d)}" for d in boards)]
    if writers:
        return [f"  logs and traces: {writers[0].run_dir} (no TensorBoard logger: log_dir= adds opkit's event files)"]
    return ["  logs: none (the Trainer has no logger; log_dir= writes opkit's TensorBoard files)"]


def report(trainer: pl.Trainer, callback: Any, writer: LogWriter | None,
           exception: BaseException | None = None) -> str | None:
    """Print the run summary and write it as ``opkit/summary`` (first opkit callback, rank zero, fit only).

    The logs it names are those every opkit callback of the Trainer writes to (one may have a ``log_dir`` of its own),
    and the summary is written to each of them.

    Args:
        trainer: the trainer whose fit ended.
        callback: the calling opkit callback.
        writer: its writer (``None``: no summary, the callback was never set up for a fit).
        exception: what ended the fit, if it failed.

    Returns:
        The summary text, or ``None`` when this callback does not write it.
    """
    if not is_first(trainer, callback) or not trainer.is_global_zero or writer is None:
        return None
    # each writer's run_dir, not run_log_dir(trainer): under DDP that is a collective, and this is rank zero
    writers = [w for w in (getattr(m, "writer", None) for m in members(trainer)) if w is not None]  # `writer` first
    written: dict[tuple[tuple[str, ...], bool], LogWriter] = {}  # each place once: most callbacks share the loggers
    for each in writers:
        if each.active:
            written.setdefault((tuple(each.tensorboard_dirs), bool(each.others)), each)
    ended = f"ended by {type(exception).__name__}: {exception}" if exception else "fit finished"
    lines = [f"opkit run summary ({ended}, global step {trainer.global_step})", *_where(list(written.values()))]
    for cb in members(trainer):
        lines += [f"  {line}" for line in cb.summary_lines()]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    for each in written.values():
        each.text("opkit/summary", "\n".join(f"    {line}" for line in lines), trainer.global_step)
        each.flush()
    return text
