"""``rules="auto"``, Trainer-free: measure each class, run the whole-step candidates, confirm them on real steps.

Every rank measures (a SyncBatchNorm's collectives need every rank in each forward) and every rank runs what rank
zero decided: each decision goes through ``agree`` (the strategy's broadcast from rank zero), so all ranks run the same
tables, the same numerics and the same compiled graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.replay import training_loss
from lightning_opkit.core.trial import Trial
from lightning_opkit.core.warn import warn_once
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.candidates import StepChoice, candidate_tables, choose_table, first_rows
from lightning_opkit.precision.decide import MIN_SPEEDUP, TIE, Decision, decide
from lightning_opkit.precision.fp8_measure import Fp8Ask, Fp8Measurements, measure_fp8
from lightning_opkit.precision.measure import measure_precision
from lightning_opkit.precision.plan import Plan
from lightning_opkit.precision.results import Measurement, PrecisionMeasurements
from lightning_opkit.precision.runner import StepRunner

__all__ = ["AutoPrecision", "describe_trial"]

def describe_trial(trial: Trial) -> str:
    """``"gemm+keep 1190.2 ms, per-class+keep 1220.5 ms (best of 2 training steps each)"``.

    The contenders (within tolerance, and close to the fastest on the first rows of a batch) are confirmed on the
    next real training steps. On a few rows the activations fit in cache, and a table that casts between classes
    looks cheaper than it is on the full batch (on the GPT-2-style LM of the benchmarks one row put such a table within
    7% of the fastest; the full batch, 36% behind). The best of each contender's steps counts, not the median: a
    table's first step on the full batch pays one-off costs (kernels and buffers for new shapes and dtypes; one such
    step measured twice its table's speed on the LM). These steps train as any other: the trial costs only the slower
    contenders' extra time.

    Example:
        >>> trial = Trial(["gemm", "keep"], rounds=1)
        >>> trial.add("gemm", 1.1902); trial.add("keep", 1.2205)
        >>> describe_trial(trial)
        'gemm 1190.2 ms, keep 1220.5 ms (best of 1 training steps each)'
    """
    best = trial.best()
    return ", ".join(f"{n} {1e3 * best[n]:.1f} ms" for n in trial.arms if n in best) + (
        f" (best of {trial.rounds} training steps each)")


#: rank zero's value, on every rank
Agree = Callable[[Any], Any]


class AutoPrecision:
    """The measurements, the whole-step choice and the trials of ``rules="auto"``, for one policy.

    Args:
        tolerance: the largest relative loss change and ``1 - cosine`` of the gradients allowed.
        whole_step: choose among whole-step candidates (else per class, as timed and lowered alone).
        trial_steps: steps per contender confirmed on real training steps (0 = none).

    Example:
        >>> auto = AutoPrecision(tolerance=0.01, whole_step=True, trial_steps=2)
        >>> auto.measure_seconds, auto.trialing
        (0.0, False)
    """

    def __init__(self, tolerance: float, whole_step: bool, trial_steps: int) -> None:
        self.tolerance = tolerance
        self.whole_step = whole_step
        self.trial_steps = trial_steps
        self.measurements: PrecisionMeasurements | None = None
        self.choice: StepChoice | None = None
        self.per_class: dict[str, Decision] = {}  # rank zero's per-class decisions
        self._trials: Trial | None = None
        self._trial_step = False  # whether this batch is a timed trial step
        self._loss_scale: float | None = None
        #: the float8 measurement per GEMM module, when one ran
        self.fp8: Fp8Measurements | None = None
        #: why float8 was not measured (``None``: not decided yet, or measured)
        self.fp8_note: str | None = None

    @property
    def measure_seconds(self) -> float:
        """What the last measurement cost: per-class timing plus the candidate runs."""
        if self.measurements is None:
            return 0.0
        return self.measurements.seconds + (self.choice.seconds if self.choice is not None else 0.0)

    @property
    def trialing(self) -> bool:
        """Whether contenders are being confirmed on the coming training steps."""
        return self._trials is not None

    @property
    def idle(self) -> bool:
        """Whether a batch's end has nothing to time (no trial, no trial step open)."""
        return self._trials is None and not self._trial_step

    def reset(self) -> None:
        """Forget trials in progress (a new fit)."""
        self._trials, self._trial_step = None, False

    # measure and decide

    def measure_and_decide(self, model: Any, batch: Any, training_step: Callable[..., Any], batch_idx: int,
                           dtypes: list[str], agree: Agree, compiled: bool, accumulating: bool,
                           loss_scale: float | None = None, fp8: Fp8Ask | None = None) -> Plan:
        """Measure on ``batch`` (its first rows, with ``whole_step``), decide, and say what to run now.

        Args:
            model: the LightningModule.
            batch: the first training batch.
            training_step: the user's own ``training_step``.
            batch_idx: its index.
            dtypes: the 16-bit dtypes to consider.
            agree: rank zero's value on every rank.
            compiled: TorchCompile is attached (compiled ties go to plain autocast; no trials).
            accumulating: gradient accumulation (no trials).
            loss_scale: the GradScaler's scale, where training scales the loss: every run differentiates the loss
                scaled like that, so fp16 gradients are judged as training gets them.
            fp8: the GEMM modules to measure in float8, once the classes are decided (or why none).
        """
        loss_fn = _loss_fn(training_step, batch_idx)
        self._loss_scale = loss_scale
        if self.whole_step:
            # Per-class timings on the rows the candidates run on: they only rank and prune the candidates, whose
            # own runs decide; errors are measured per table, as a whole.
            measurements = self._measure(model, first_rows(batch)[0], loss_fn, dtypes=dtypes, errors=False, reps=3)
        else:
            measurements = self._measure(model, batch, loss_fn, dtypes=dtypes)
        decisions = decide(measurements, self.tolerance, dtypes, require_errors=not self.whole_step) \
            if measurements is not None else {}
        chosen: dict[str, Decision] = agree(decisions)
        choice = None
        if self.whole_step and chosen:
            # The candidates come from rank zero's per-class decisions, so every rank runs the same tables.
            choice = agree(self._choose(model, batch, loss_fn, measurements.rows if measurements else [],
                                        Plan(chosen).dtypes, dtypes, agree, compiled))
        self.per_class, self.choice, self.measurements = chosen, choice, measurements
        # A re-measurement ends the trials of the last one, and the step it began for one of their contenders.
        self.reset()
        self.fp8, self.fp8_note = None, fp8.note if fp8 is not None else None
        plan = Plan(chosen) if choice is None else self.plan_for(choice.chosen)
        if fp8 is not None and fp8.modules and plan.classes:
            self._measure_fp8(model, batch, loss_fn, fp8, plan, agree)
        if choice is None:
            return Plan(chosen, fp8=self.fp8.chosen if self.fp8 is not None else {})
        if self.trial_steps and len(choice.contenders()) > 1:
            if compiled or accumulating:
                self.choice = choice.confirmed(choice.chosen, "not run (" + (
                    "TorchCompile attached: each table would recompile" if compiled else "gradient accumulation") + ")")
            else:
                self._trials = Trial(choice.contenders(), self.trial_steps)
        return self.plan_for(choice.chosen)

    def _measure(self, model: Any, batch: Any, loss_fn: Callable[..., Tensor],
                 **kwargs: Any) -> PrecisionMeasurements | None:
        try:
            return measure_precision(model, lambda: batch, device=model.device, loss_fn=loss_fn,
                                     loss_scale=self._loss_scale, **kwargs)
        except Exception as err:  # a measurement that fails must not end the training it was meant to speed up
            warn_once(f"PrecisionPolicy could not measure this model ({type(err).__name__}: {err}); the policy"
                           f" keeps its table (every class in fp32).")
            return None

    def _measure_fp8(self, model: Any, batch: Any, loss_fn: Callable[..., Tensor], ask: Fp8Ask, plan: Plan,
                     agree: Agree) -> None:
        """Measure ``ask``'s modules in float8 against the dtype ``plan`` runs their class in."""
        base = plan.autocast or (plan.classes["matmul"].dtype if "matmul" in plan.classes else "bf16")
        if base not in ("bf16", "fp32"):
            self.fp8_note = f"the matmul class runs in {base}: float8 is measured against bf16 or fp32 only"
            return
        sub, rows = first_rows(batch) if self.whole_step else (batch, 1)
        full = first_rows(batch, 1)[1] if self.whole_step else 1
        runner = StepRunner(model, sub, loss_fn, self._loss_scale)
        try:
            with runner.session():
                self.fp8 = measure_fp8(runner, ask.modules, model.device, ask.recipe, base, self.tolerance,
                                       scale=full / rows, agree=agree)
        except Exception as err:
            warn_once(f"PrecisionPolicy could not measure float8 ({type(err).__name__}: {err}); no module runs in"
                      f" float8 by rules='auto'.")
            self.fp8_note = f"its measurement failed ({type(err).__name__})"

    def fp8_lines(self) -> list[str]:
        """The run summary's lines on float8: what was measured and chosen, or why nothing was tried."""
        if self.fp8 is not None:
            return self.fp8.lines()
        return [f"  fp8: not tried by rules='auto' ({self.fp8_note})"] if self.fp8_note else []

    def _choose(self, model: Any, batch: Any, loss_fn: Callable[..., Tensor], rows: list[Measurement],
                per_class: dict[str, str], dtypes: list[str], agree: Agree, compiled: bool) -> StepChoice | None:
        """Run the whole-step candidates on the first rows of ``batch`` and choose one (``None`` if that fails)."""
        low = per_class["matmul"] if per_class.get("matmul") in dtypes else dtypes[0]
        tables = candidate_tables(per_class, sorted(per_class, key=OP_CLASSES.index), low)
        sub, n = first_rows(batch)
        runner = StepRunner(model, sub, loss_fn, self._loss_scale)
        try:
            with runner.session():
                return choose_table(runner, tables, rows, self.tolerance, n, low, agree=agree, compiled=compiled)
        except Exception as err:
            warn_once(f"PrecisionPolicy could not run the whole-step candidates ({type(err).__name__}: {err});"
                           f" it keeps the per-class decisions.")
            return None

    def plan_for(self, name: str) -> Plan:
        """The plan of candidate ``name`` of the current choice."""
        assert self.choice is not None
        run = next(r for r in self.choice.runs if r.name == name)
        # Plain autocast leaves every class to autocast: "keep" for the policy, whose mode stands aside.
        table = run.table or dict.fromkeys(self.per_class, "keep")
        what = f"plain torch.autocast in {run.autocast}" if run.autocast else f"table '{run.name}'"
        return Plan({c: Decision(c, table[c], f"{what} ({run.figures()}); per class:"
                                              f" {self.per_class[c].reason if c in self.per_class else '-'}")
                     for c in table}, run.autocast, self.fp8.chosen if self.fp8 is not None else {})

    # trials: the contenders on real training steps

    def begin_trial_step(self, device: torch.device, census_step: bool) -> Plan | None:
        """At a batch's start while trialing: the contender this step runs (``None`` on a census step)."""
        assert self._trials is not None
        if census_step:
            self._trial_step = False  # a census step recomputes every op in fp32: not a fair sample
            return None
        name = self._trials.next()
        if name is None:
            return None
        self._trials.start(name, device)
        self._trial_step = True
        return self.plan_for(name)

    def end_trial_step(self, device: torch.device, agree: Agree) -> Plan | None:
        """At a batch's end: time the contender; when every contender had its steps, the winner's plan."""
        trials, taken = self._trials, self._trial_step
        self._trial_step = False
        if trials is None or not taken or self.choice is None:
            return None
        trials.stop()
        if not trials.done:
            return None
        # Rank zero's step times decide, so every rank trains on with the same table.
        self.choice = self.choice.confirmed(agree(trials.winner(TIE)), agree(describe_trial(trials)),
                                            agree({n: 1e3 * t for n, t in trials.best().items()}))
        self._trials = None
        return self.plan_for(self.choice.chosen)

    def abandon_trials(self) -> Plan | None:
        """The fit ended before every contender had its steps: the choice on the measured rows stands."""
        if self._trials is None or self.choice is None:
            return None
        taken, total = self._trials.calls, len(self._trials.order)
        self.choice = self.choice.confirmed(self.choice.chosen,
                                            f"not finished (the fit ended after {taken} of {total} trial steps)")
        self.reset()
        return self.plan_for(self.choice.chosen)

    # what it shows

    def sensitivity_markdown(self, decided: dict[str, str]) -> str:
        """``opkit/precision/sensitivity``: each class's measurements, then the candidates (assumes measurements)."""
        assert self.measurements is not None
        text = self.measurements.table(decided)
        return text + ("\n\n" + self.choice.table() if self.choice is not None else "")

    def decision_markdown(self, decisions: dict[str, Decision], note: str = "") -> str:
        """``opkit/precision/decision``: the rule, the comparison with bf16-mixed, each class's evidence."""
        assert self.measurements is not None
        head = (f"tolerance {self.tolerance:g}, at least {MIN_SPEEDUP:.2f}x faster than fp32; measured on"
                f" {self.measurements.device}.\n\n")
        if self.choice is not None:
            head += f"{self.choice.comparison()}.\n\n"
        if note:
            head += f"{note}.\n\n"
        evidence = markdown_table(["op class", "dtype", "evidence"], [[c, d.dtype, d.reason]
                                                                      for c, d in decisions.items()])
        fp8 = f"\n\n{self.fp8.markdown()}" if self.fp8 is not None else (
            f"\n\nfloat8 not tried: {self.fp8_note}." if self.fp8_note else "")
        return head + evidence + ("\n\n" + self.choice.table() if self.choice is not None else "") + fp8


def _loss_fn(training_step: Callable[..., Any], batch_idx: int) -> Callable[[torch.nn.Module, Any], Tensor]:
    def loss_fn(model: Any, b: Any) -> Tensor:  # the LightningModule
        loss = training_loss(model, b, batch_idx, training_step)
        if loss is None:
            raise ValueError("training_step returned no loss")
        return loss

    return loss_fn
