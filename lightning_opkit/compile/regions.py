"""Compiled regions: what each region cost and gained, and dynamo's cache entries per code object.

A small record per region and plain functions, tested without a Trainer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REGION_HEADERS", "Region"]


@dataclass
class Region:
    """What one compiled region cost and gained in this run (compile figures are dynamo's, during its calls)."""

    name: str
    code: Any = None  # the code object dynamo caches on (shared by identical blocks)
    calls: int = 0
    compiles: int = 0
    compile_time_s: float = 0.0
    graphs: int = 0
    graph_breaks: int = 0
    recompiles: int = 0
    recompile_reasons: list[str] = field(default_factory=list)
    #: recompiles every run has and that stay bounded (grad modes, the policy's table, a size marked dynamic)
    expected_recompiles: int = 0
    #: the recompiles that were not: a guard that keeps failing
    unexpected: list[str] = field(default_factory=list)
    expected_seen: Counter[str] = field(default_factory=Counter)
    speedup: float | None = None  # eager time / compiled time, once measured
    timing: bool = False  # its eager-against-compiled calls have begun (until ``speedup`` is set)
    eager: bool = False  # switched to eager on its recompile limit
    slower: bool = False  # runs eagerly: compiled measured slower (eager_if_slower)

    @property
    def runs(self) -> str:
        """How it runs now: ``"compiled"``, or eager and why."""
        if self.slower:
            return "eager (compiled measured slower)"
        return "eager_on_recompile (recompile limit)" if self.eager else "compiled"

    def row(self) -> list[Any]:
        """The region's row in the per-region table."""
        speed = "-" if self.speedup is None else f"{self.speedup:.2f}x"
        return [self.name or "<LightningModule>", self.calls, self.compiles, f"{self.compile_time_s:.2f}",
                self.graphs, self.graph_breaks, self.recompiles, self.expected_recompiles, speed, self.runs]


REGION_HEADERS = ["region", "calls", "compiles", "compile s", "graphs", "graph breaks", "recompiles",
                  "of them expected", "speedup (eager/compiled)", "runs"]
