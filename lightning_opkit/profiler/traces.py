"""A window's trace file: written where TensorBoard's profiler plugin reads it, the oldest dropped past a limit."""

from __future__ import annotations

import os
import time
from typing import Any

from lightning_opkit.core.warn import warn_once

__all__ = ["write_trace", "write_trace_or_warn"]


def write_trace(prof: Any, folder: str, rank: int, step: int, gzip: bool, written: list[str],
                keep: int | None) -> float:
    """Export ``prof``'s trace as ``<folder>/rank<rank>.<step>.pt.trace.json[.gz]``; the seconds it took.

    Args:
        prof: the window's stopped ``torch.profiler.profile``.
        folder: the traces folder (made if missing).
        rank: the global rank.
        step: the global step the window ended at.
        gzip: gzip the file (Perfetto and chrome://tracing open it).
        written: this run's trace paths, oldest first: the new one is appended, the oldest past ``keep`` removed.
        keep: how many of this run's traces to keep; ``None``: all.
    """
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank{rank}.{step}.pt.trace.json" + (".gz" if gzip else ""))
    t0 = time.perf_counter()
    prof.export_chrome_trace(path)
    elapsed = time.perf_counter() - t0
    written.append(path)
    while keep and len(written) > keep:
        old = written.pop(0)
        if os.path.exists(old):
            os.remove(old)
    return elapsed


def write_trace_or_warn(prof: Any, folder: str, rank: int, step: int, gzip: bool, written: list[str],
                        keep: int | None) -> float | None:
    """:func:`write_trace`, or, where it fails (an unwritable folder, a full disk), a warning once and ``None``.

    A trace is not worth the run: training goes on without it.
    """
    try:
        return write_trace(prof, folder, rank, step, gzip, written, keep)
    except Exception as err:
        warn_once(f"ProfilerWindows: could not write the trace of the window at step {step} to {folder!r}"
                  f" ({type(err).__name__}: {err}); training goes on.", key=("profiler", "trace export failed"),
                  stacklevel=3)
        return None
