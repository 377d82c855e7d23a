"""Whole-step decisions: candidate class tables, each run on the real step for its time and its error as a whole.

Per-class timings alone mislead: each class is timed in isolation, and the casts between classes a table implies
are not counted (GEMMs in bf16 with the elementwise ops between them in fp32 casts every activation up and down
again). So :func:`choose_table` runs a few whole tables on the model's own step (on the first rows of the real
batch, to keep it cheap): all-fp32; GEMMs in 16-bit with the precision-sensitive classes in fp32 and the rest
``keep`` (run in whatever dtype their input arrives in, no cast: autocast's behaviour for them); the per-class pick;
and the per-class pick with ``keep``. Each is timed (forward + backward) and its error measured against fp32 as a
whole (loss change, gradient cosine), beside plain autocast (what ``precision="bf16-mixed"`` runs) on the same batch.
Plain autocast is a candidate too: the one with none of the mode's per-op host cost. The fastest candidate within
tolerance wins; one within :data:`TIE` of it that is closer to fp32 wins the tie.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.text import describe_error
from lightning_opkit.core.timing import sync
from lightning_opkit.core.torch_compat import tree_leaves, tree_map
from lightning_opkit.opclass import GEMM_CLASSES, OP_CLASSES
from lightning_opkit.precision.decide import TIE
from lightning_opkit.precision.dtypes import DTYPES
from lightning_opkit.precision.results import Measurement
from lightning_opkit.precision.runner import StepRunner, device_of, grad_cosine, loss_change, step_error

__all__ = ["SENSITIVE_CLASSES", "StepChoice", "TableRun", "candidate_tables", "choose_table",
           "first_rows"]

#: classes kept in fp32 by every candidate but the per-class pick: variances, exponents, large sums
SENSITIVE_CLASSES = ("norm", "softmax", "loss", "reduction")
#: a table predicted this many times slower than the fastest (from per-class timings) is not run at all
_PREDICTED_SLOWER = 1.3
#: after the first timing, tables this many times slower than the fastest are not timed again
_RETIME_WITHIN = 1.25
#: rounds of samples after the first, for the tables still in the race
_RETIMES = 4
#: the share of the batch the candidates run on (at least one row)
ROWS_FRACTION = 8

#: the candidate that is plain ``torch.autocast`` (what ``precision="bf16-mixed"`` runs), no policy mode
AUTOCAST = "autocast"


@dataclass
class TableRun:
    """One candidate table run on the step: its time and its error against fp32 as a whole.

    Args:
        name: the candidate's name.
        table: op class -> dtype name (``"keep"``: the input's dtype) for the classes the model ran.
        ms: forward + backward time on the measured rows, the best of its samples; ``None`` if not run.
        loss_change: ``|loss - loss_fp32| / |loss_fp32|``.
        grad_cosine: cosine of all gradients to the fp32 gradients.
        predicted: time predicted from per-class timings, as a multiple of the fastest prediction.
        skipped: why it was not run, if it was not.
        failed: why its run raised, if it did.
        samples: every timed sample (ms); ``ms`` is the best of them.
        autocast: for the :data:`AUTOCAST` candidate, the dtype name plain ``torch.autocast`` runs in (``table`` is
            empty); ``None`` for a table.
    """

    name: str
    table: dict[str, str]
    ms: float | None = None
    loss_change: float | None = None
    grad_cosine: float | None = None
    predicted: float | None = None
    skipped: str | None = None
    failed: str | None = None
    samples: list[float] = field(default_factory=list)
    autocast: str | None = None

    @property
    def error(self) -> float:
        """How far from fp32 as one number (:func:`~lightning_opkit.precision.runner.step_error`)."""
        return step_error(self.loss_change, self.grad_cosine)

    def within(self, tolerance: float) -> bool:
        """Whether it ran and stays within ``tolerance`` (loss change and ``1 - grad cosine``)."""
        return self.ms is not None and self.failed is None and self.error <= tolerance

    def describe(self) -> str:
        """``"matmul, attention in bf16; norm in fp32; pointwise keep"``."""
        if self.autocast is not None:
            return f"plain torch.autocast in {self.autocast} ({_trainer_precision(self.autocast)}), no policy mode"
        by: dict[str, list[str]] = {}
        for cls in sorted(self.table, key=OP_CLASSES.index):
            by.setdefault(self.table[cls], []).append(cls)
        return "; ".join(f"{', '.join(v)} {'keep' if k == 'keep' else 'in ' + k}" for k, v in by.items()) or "-"

    def figures(self) -> str:
        """``"312.4 ms, loss change 1.2e-05, grad cosine 0.999968"``."""
        if self.ms is None:
            return f"not run ({self.skipped or self.failed})"
        cos = "-" if self.grad_cosine is None else f"{self.grad_cosine:.6f}"
        return f"{self.ms:.1f} ms, loss change {self.loss_change:.2e}, grad cosine {cos}"


@dataclass(frozen=True)
class StepChoice:
    """The candidates, plain autocast beside them, and the table chosen; a confirmation makes a new one.

    Args:
        runs: the candidates in the order they were built, plain autocast (:data:`AUTOCAST`) last: it is the
            ``bf16-mixed`` comparison and a candidate too, the one with no per-op cost of the policy's mode.
        chosen: the name of the chosen candidate.
        rows: how many rows of the batch the runs used.
        seconds: what the runs cost, wall clock.
        tolerance: the tolerance the choice was held to.
    """

    runs: list[TableRun]
    chosen: str
    rows: int
    seconds: float
    tolerance: float

    #: how the choice was confirmed on real training steps (:func:`~lightning_opkit.precision.auto.describe_trial`)
    trial: str | None = None
    #: each contender's fastest trial step, in ms, as recorded (``trial`` says it in words, rounded)
    trial_ms: dict[str, float] | None = None

    def confirmed(self, chosen: str, trial: str, trial_ms: dict[str, float] | None = None) -> StepChoice:
        """This choice after its trial steps: ``chosen`` won them (``trial`` says how, or why none ran)."""
        return dataclasses.replace(self, chosen=chosen, trial=trial, trial_ms=trial_ms)

    @property
    def best(self) -> TableRun:
        """The chosen run."""
        return next(r for r in self.runs if r.name == self.chosen)

    @property
    def autocast(self) -> TableRun | None:
        """Plain autocast's run on the same rows (the ``bf16-mixed`` comparison)."""
        return next((r for r in self.runs if r.autocast is not None), None)

    def contenders(self) -> list[str]:
        """The chosen table first, then every other within tolerance and within 25% of it on the measured rows."""
        best = self.best
        close = [r.name for r in self.runs if r is not best and r.within(self.tolerance) and r.ms is not None
                 and best.ms is not None and r.ms <= _RETIME_WITHIN * best.ms]
        return [best.name, *close]

    def table(self) -> str:
        """The candidates as markdown: time, error and whether chosen, with autocast's row for comparison."""
        runs = self.runs
        fastest = min((r.ms for r in runs if r.ms is not None), default=None)
        body = [[r.name, r.describe(),
                 "-" if r.ms is None else f"{r.ms:.1f}",
                 "-" if r.ms is None or not fastest else f"{r.ms / fastest:.3f}",
                 "-" if r.loss_change is None else f"{r.loss_change:.2e}",
                 "-" if r.grad_cosine is None else f"{r.grad_cosine:.6f}",
                 "yes" if r.name == self.chosen else (r.skipped or r.failed or "no")] for r in runs]
        head = (f"Whole-step candidates, forward + backward on {self.rows} row(s) of the batch, measured in"
                f" {self.seconds:.2f} s; errors against fp32 on the same rows; tolerance {self.tolerance:g};"
                f" within {TIE:.0%} of the fastest, the table closest to fp32 wins.\n\n")
        return head + markdown_table(["table", "classes", "ms", "vs fastest", "loss change", "grad cosine",
                                      "chosen"], body)

    def comparison(self) -> str:
        """One line: the chosen table's error beside plain autocast's, on the same batch."""
        best = self.best
        line = f"chosen table '{best.name}': {best.figures()}"
        autocast = self.autocast
        if autocast is not None and autocast is not best and autocast.ms is not None:
            line += f"; plain {_trainer_precision(autocast.autocast or 'bf16')} on the same rows: {autocast.figures()}"
        if self.trial:
            line += f"; confirmed on training steps: {self.trial}"
        return line


def _trainer_precision(dtype: str) -> str:
    """The Trainer precision that runs plain autocast in ``dtype``: ``"bf16-mixed"`` or ``"16-mixed"``."""
    return "bf16-mixed" if dtype == "bf16" else "16-mixed"


def first_rows(batch: Any, fraction: int = ROWS_FRACTION) -> tuple[Any, int]:
    """The first ``1/fraction`` of the batch's rows (at least one), and how many that is.

    Every tensor whose first dimension is the batch size (that of the first tensor in the batch) is sliced; other
    values are kept. A batch with no tensor is returned whole.
    """
    leaves = [t for t in tree_leaves(batch) if isinstance(t, Tensor) and t.dim() > 0]
    if not leaves:
        return batch, 1
    size = leaves[0].shape[0]
    rows = max(1, size // fraction)
    if rows == size:
        return batch, size
    return tree_map(lambda t: t[:rows] if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == size else t,
                    batch), rows


def candidate_tables(per_class: dict[str, str], classes: Sequence[str], low: str = "bf16") -> dict[str, dict[str, str]]:
    """The whole-step candidates over ``classes`` (the classes the model ran), duplicates removed.

    Args:
        per_class: op class -> dtype name chosen class by class (from per-class timings).
        classes: the governed classes the model ran.
        low: the 16-bit dtype for the GEMM candidate.

    Example:
        >>> tables = candidate_tables({"matmul": "bf16", "norm": "fp32"}, ["matmul", "norm", "pointwise"])
        >>> tables["gemm+keep"]
        {'matmul': 'bf16', 'norm': 'fp32', 'pointwise': 'keep'}
        >>> list(tables)  # the pick with keep is gemm+keep here: one candidate
        ['fp32', 'gemm+keep', 'per-class']
    """
    fp32 = dict.fromkeys(classes, "fp32")
    gemm = {c: low if c in GEMM_CLASSES else "fp32" if c in SENSITIVE_CLASSES else "keep" for c in classes}
    pick = {c: per_class.get(c, "fp32") for c in classes}
    # Never ``keep`` for a GEMM: a matmul does not promote mixed inputs (a bf16 activation, an fp32 weight) and fails.
    pick_keep = {c: "keep" if d == "fp32" and c not in SENSITIVE_CLASSES and c not in GEMM_CLASSES else d
                 for c, d in pick.items()}
    out: dict[str, dict[str, str]] = {}
    for name, table in (("fp32", fp32), ("gemm+keep", gemm), ("per-class", pick), ("per-class+keep", pick_keep)):
        lowers = any(d not in ("fp32", "keep") for d in table.values())
        # ``keep`` with nothing lowered is fp32 in disguise: not a candidate of its own.
        if table not in out.values() and (lowers or "keep" not in table.values()):
            out[name] = table
    return out


def _predicted(table: dict[str, str], speeds: dict[tuple[str, str], Measurement]) -> float:
    """Op time of ``table`` from per-class timings (``keep`` counted as fp32: its dtype is not known beforehand).

    Each class weighs its measured fp32 time; classes without one (rows built by hand) weigh alike.
    """
    fp32_ms = {c: r.fp32_ms for (c, _), r in speeds.items() if r.fp32_ms is not None}
    default = sum(fp32_ms.values()) / len(fp32_ms) if fp32_ms else 1.0
    total = 0.0
    for cls, name in table.items():
        row = speeds.get((cls, name))
        ratio = row.time_ratio if row is not None and row.time_ratio is not None and not row.failed else 1.0
        total += fp32_ms.get(cls, default) * ratio
    return total


def _timed_run(runner: StepRunner, run: TableRun,
               ref: tuple[Tensor, list[Tensor | None]] | None) -> tuple[Tensor, list[Tensor | None]] | None:
    """Run ``run``'s table once, add a time sample and (against ``ref``) its errors; the loss and grads, or ``None``."""
    device = device_of(runner.model)
    autocast = DTYPES[run.autocast] if run.autocast is not None else None
    try:
        # A whole step between two synchronizations: its kernels' time dwarfs the sync's on any device.
        sync(device)
        began = time.perf_counter()
        loss, grads = runner.run(None if autocast is not None else run.table, autocast=autocast)
        sync(device)
    except Exception as err:  # a table with no kernel for some op on this device
        run.failed = describe_error(err, 100)
        return None
    run.samples.append(1e3 * (time.perf_counter() - began))
    run.ms = min(run.samples)
    if ref is not None:
        run.loss_change = loss_change(loss, ref[0])
        run.grad_cosine = grad_cosine(grads, ref[1])
    return loss, grads


def choose_table(runner: StepRunner, tables: dict[str, dict[str, str]], rows: Sequence[Measurement],
                 tolerance: float, batch_rows: int, low: str = "bf16",
                 agree: Callable[[Any], Any] = lambda value: value, compiled: bool = False) -> StepChoice:
    """Run each candidate table on the step, with plain autocast beside them, and choose the table to train with.

    Call it inside ``runner.session()``. The first table is all-fp32: its run is the reference for every error. A
    table predicted (from the per-class timings ``rows``) far slower than the fastest prediction is not run: on a
    CPU without native bf16 units a bf16 step can take ten times fp32's.

    Args:
        runner: runs the step on the measured rows.
        tables: name -> table, from :func:`candidate_tables`; the first is the fp32 table.
        rows: per-class speed measurements.
        tolerance: the largest loss change and ``1 - grad cosine`` a table may cause.
        batch_rows: how many rows of the batch ``runner`` runs (for the report).
        low: the 16-bit dtype plain autocast runs in.
        agree: makes every rank take rank zero's value (``trainer.strategy.broadcast``): which tables run, and how
            often, so that every rank runs the same steps in lockstep (a SyncBatchNorm, a sharded model).
        compiled: the model trains under TorchCompile: plain autocast wins a tie at the smallest error, since eager
            times rank compiled code poorly.
    """
    began = time.perf_counter()
    speeds = {(r.op_class, r.dtype): r for r in rows}
    runs = [TableRun(name, table) for name, table in tables.items()]
    runs.append(TableRun(AUTOCAST, {}, autocast=low))
    # Autocast lowers the GEMM classes and leaves the rest in their inputs' dtype: predicted like that table.
    like_autocast = {c: low if c in GEMM_CLASSES else "keep" for c in runs[0].table}
    predictions = {r.name: _predicted(r.table if r.autocast is None else like_autocast, speeds) for r in runs}
    floor = min(predictions.values(), default=0.0)
    for run in runs[1:]:
        run.predicted = predictions[run.name] / floor if floor > 0 else 1.0
        if run.predicted > _PREDICTED_SLOWER:
            run.skipped = f"predicted {run.predicted:.1f}x slower from per-class timings"
    skipped = agree({r.name: r.skipped for r in runs})
    for run in runs:
        run.skipped = skipped.get(run.name)
    ref = _timed_run(runner, runs[0], None)
    if ref is None:
        raise RuntimeError(f"the fp32 run of the step failed ({runs[0].failed})")
    runs[0].loss_change, runs[0].grad_cosine = 0.0, grad_cosine(ref[1], ref[1])
    for run in runs[1:]:
        if run.skipped is None:
            _timed_run(runner, run, ref)
    # More samples for the candidates still in the race, in turn and in alternating order so that drift and another
    # process's bursts hit them alike; each keeps its fastest. The fp32 reference always gets them: it ran first, and
    # one cold sample of it must not hand the step to a table that only looked faster (a tiny model on a CPU without
    # bf16 units measured fp32 1.6x slower than itself). Two samples each let the verdict flip with the machine's load
    # (the example ViT beside a test run chose plain autocast, alone the fp32 table): a step on a few rows is cheap.
    for round_no in range(_RETIMES):
        fastest = min((r.ms for r in runs if r.within(tolerance) and r.ms is not None), default=None)
        race = [r.name for r in runs if fastest is not None and r.within(tolerance) and r.ms is not None
                and (r is runs[0] or r.ms <= _RETIME_WITHIN * fastest)]
        for name in agree(race[::-1] if round_no % 2 == 0 else race):
            _timed_run(runner, next(r for r in runs if r.name == name), None)
    return StepChoice(runs, _pick(runs, tolerance, compiled), batch_rows, time.perf_counter() - began, tolerance)


def _pick(runs: list[TableRun], tolerance: float, autocast_wins_ties: bool = False) -> str:
    good = [r for r in runs if r.within(tolerance)]
    if not good:
        return runs[0].name
    fastest = min(r.ms for r in good if r.ms is not None)
    ties = [r for r in good if r.ms is not None and r.ms <= (1 + TIE) * fastest]
    closest = min(r.error for r in ties)
    if autocast_wins_ties:
        # At equal error the numerics are autocast's: its eager time on the measured rows says little about compiled
        # code, where the casts fuse, so the obvious alternative itself is taken.
        same = [r for r in ties if r.autocast is not None and r.error <= closest]
        if same:
            return same[0].name
    return min(ties, key=lambda r: (r.error, r.ms)).name
