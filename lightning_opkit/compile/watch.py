"""Watch torch.compile from the outside: compile time, graphs, graph breaks and recompile reasons.

Reads dynamo's public start/end compile callbacks, its counters and its ``recompiles`` log artifact, and undoes
every change it makes when closed.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any

from lightning_opkit.core.dynamo_compat import RECOMPILES_LOGGER, counters, recompiles_artifact, watch_compiles


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(level=logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


class DynamoWatch:
    """Counts compiles and their time, graphs, graph breaks (with reasons) and recompiles (with reasons).

    Counters are process-wide, so figures are deltas from :meth:`open`.

    Example:
        >>> watch = DynamoWatch()
        >>> watch.open()
        >>> watch.close()
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_time_s = 0.0
        self.recompile_reasons: list[str] = []
        self._t0: float | None = None
        #: the compiled region being called (set by TorchCompile around each call): its compiles are charged to it
        self.region: Any = None
        self._at_start: tuple[int, int] = (0, 0)
        found = counters()
        self._base_breaks: Counter[str] = Counter(found["graph_break"])
        self._base_break_total = sum(self._base_breaks.values())
        self._base_graphs = found["stats"]["unique_graphs"]
        # before open() nothing was watched: a TorchCompile that never set up reports 0, not dynamo's process totals
        self._base_frames = found["frames"]["ok"]
        self._base_attempted = found["frames"]["total"]
        self._handler: _Collect | None = None
        self._logger_state: tuple[int, bool] | None = None
        self._enabled_artifact = False

    def open(self) -> None:
        """Start watching: register callbacks and the recompile log handler."""
        found = counters()
        self._base_breaks = Counter(found["graph_break"])
        self._base_break_total = sum(self._base_breaks.values())
        self._base_graphs = found["stats"]["unique_graphs"]
        self._base_frames = found["frames"]["ok"]
        self._base_attempted = found["frames"]["total"]
        watch_compiles(self._on_start, self._on_end, on=True)
        if not recompiles_artifact():
            recompiles_artifact(enable=True)
            self._enabled_artifact = True
        logger = logging.getLogger(RECOMPILES_LOGGER)
        self._logger_state = (logger.level, logger.propagate)
        self._handler = _Collect(self.recompile_reasons)
        logger.addHandler(self._handler)
        logger.setLevel(logging.DEBUG)
        # Ours is the only consumer we turned on: keep torch's console handlers quiet unless the user enabled them.
        logger.propagate = not self._enabled_artifact

    def close(self) -> None:
        """Stop watching and undo every change (idempotent)."""
        if self._handler is None:
            return
        watch_compiles(self._on_start, self._on_end, on=False)  # never registered (open failed half-way): no error
        logger = logging.getLogger(RECOMPILES_LOGGER)
        logger.removeHandler(self._handler)
        if self._logger_state is not None:
            logger.setLevel(self._logger_state[0])
            logger.propagate = self._logger_state[1]
        if self._enabled_artifact:
            recompiles_artifact(enable=False)
            self._enabled_artifact = False
        self._handler = None

    def _on_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()
        self._at_start = (self.graphs, self.graph_break_total)

    def _on_end(self, *args: Any) -> None:
        elapsed = 0.0
        if self._t0 is not None:
            elapsed = time.perf_counter() - self._t0
            self.compile_time_s += elapsed
            self._t0 = None
        self.compiles += 1
        region = self.region
        if region is not None:
            region.compiles += 1
            region.compile_time_s += elapsed
            region.graphs += self.graphs - self._at_start[0]
            region.graph_breaks += self.graph_break_total - self._at_start[1]

    @property
    def graph_break_total(self) -> int:
        """Graph breaks since :meth:`open`, all reasons together."""
        return sum(counters()["graph_break"].values()) - self._base_break_total

    @property
    def graphs(self) -> int:
        """Graphs compiled since :meth:`open`."""
        return counters()["stats"]["unique_graphs"] - self._base_graphs

    @property
    def frames(self) -> int:
        """Frames dynamo converted since :meth:`open` (0 means no compiled code ran)."""
        return counters()["frames"]["ok"] - self._base_frames

    @property
    def frames_attempted(self) -> int:
        """Frames dynamo tried to convert since :meth:`open`, converted or skipped."""
        return counters()["frames"]["total"] - self._base_attempted

    def graph_breaks(self) -> dict[str, int]:
        """Graph-break reason -> count, since :meth:`open`."""
        now = Counter(counters()["graph_break"])
        now.subtract(self._base_breaks)
        return {reason.split("\n\n")[0].strip(): n for reason, n in now.items() if n > 0}


_FUNCTION = re.compile(r"Recompiling function (\S+) in (\S+)")
_GUARD = re.compile(r"^\s*- (?:\d+/\d+: )?(.+?)\s*(?:#.*)?$", re.M)


def recompile_table(reasons: list[str]) -> list[list[Any]]:
    """Recompile reasons as deduplicated ``[function, guard that failed, count]`` rows, most frequent first.

    Args:
        reasons: dynamo's ``recompiles`` log messages.

    Example:
        >>> msg = "Recompiling function forward in m.py:3 ... failure(s):|    - 0/0: x.size()[0] == 8"
        >>> recompile_table([msg.replace("|", chr(10))] * 2)
        [['forward (m.py:3)', 'x.size()[0] == 8', 2]]
    """
    counts: Counter[tuple[str, str]] = Counter()
    for reason in reasons:
        function = _FUNCTION.search(reason)
        where = f"{function.group(1)} ({function.group(2)})" if function else "-"
        guards = failed_guards(reason)
        counts[(where, guards[0] if guards else " ".join(reason.split())[:200])] += 1
    return [[where, guard, n] for (where, guard), n in counts.most_common()]


def failed_guards(reason: str) -> list[str]:
    r"""The guards a recompile message lists as failed, newest cache entry first.

    Example:
        >>> failed_guards("Recompiling function forward in m.py:3 ... failure(s):\n - 0/1: x.size()[0] == 8\n"
        ...               " - 0/0: GLOBAL_STATE changed: grad_mode")
        ['x.size()[0] == 8', 'GLOBAL_STATE changed: grad_mode']
    """
    return [g for g in _GUARD.findall(reason) if not g.startswith(("User stack", "File ", "if ", "return "))]


#: recompiles every run has, each bounded: a guard of this kind failing up to so many times per compiled code is
#: expected (train/eval/inference grad modes; a precision policy's table changing after it measured; a size that
#: changed once in training and once in evaluation, whose code for each grad mode then has the dimension dynamic)
_EXPECTED: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"GLOBAL_STATE changed: grad_mode"), 2),
    (re.compile(r"\.class_dtypes\["), 4),
    (re.compile(r"size mismatch at index \d+|\.size\(\)\[\d+\]|\.stride\(\)\[\d+\]"), 2),
)


#: torch before 2.11 compiles a torch.nn ``forward`` through dynamo's own wrapper frame (``external_utils.inner``),
#: one code object for every callable it wraps: its cache gains an entry per wrapped bound method (each region, each
#: fit), guarded on that callable's identity, and loses those whose callable was freed. Dynamo's limit counts entries
#: per such callable, so these are no recompiles of a region's graph.
_WRAPPER = re.compile(r"function inner in \S*external_utils\.py")
_ANOTHER_CALLABLE = re.compile(r"check_obj_id\(fn,|\['fn'\] got deallocated")


def expected_recompile(reason: str, seen: Counter[str], sizes_dynamic: bool = True) -> bool:
    """Whether a recompile is one every run has and that stays bounded (then counted in ``seen``).

    The newest failure decides: a grad-mode change (training, validation, inference), the precision policy's table,
    or a size seen changing for the first time (only where dynamo then marks it dynamic: not with ``dynamic=False``).
    Past its budget the same kind of guard "keeps failing", and is worth a warning.

    Args:
        reason: dynamo's recompile message.
        seen: expected failures so far for this compiled code, by kind (updated).
        sizes_dynamic: dynamo marks a changed dimension dynamic (``dynamic`` is not ``False``).

    Example:
        >>> from collections import Counter
        >>> seen = Counter()
        >>> [expected_recompile("- 0/0: GLOBAL_STATE changed: grad_mode", seen) for _ in range(3)]
        [True, True, False]
    """
    guards = failed_guards(reason)
    if not guards:
        return False
    if _WRAPPER.search(reason) and _ANOTHER_CALLABLE.search(guards[0]):
        return True  # another wrapped callable (another region, another fit), not this region's graph again
    newest = re.sub(r"\d+", "#", guards[0])
    for pattern, budget in _EXPECTED:
        if pattern.search(guards[0]):
            if pattern.pattern.startswith("size") and not sizes_dynamic:
                return False
            if seen[newest] < budget:
                seen[newest] += 1
                return True
            return False
    return False
