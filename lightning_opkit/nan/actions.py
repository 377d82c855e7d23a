"""What NaNDetector does about a fault: repair it where the cause is precision, count it, log it, then act.

The detector finds a fault and a replay builds its report (:mod:`~lightning_opkit.nan.replays`); from there the
report goes through :class:`Actions` alone: amended with the repair (:mod:`~lightning_opkit.nan.repair`) or with what
loss scaling cannot do, kept, written with the run's counters (to the writer the detector opened), and acted on:
``raise`` a :class:`NonFiniteError`, ``skip`` the optimizer step (:class:`StepSkipper`), ``warn`` once a kind of
fault, or ``stop``.

The :class:`StepSkipper` is the one place that answers "what happens on a skipped step". Per batch it moves through
:class:`BatchState`:

- ``UNCHECKED``: not a checked step; the optimizer steps as usual.
- ``CHECKING``: a checked step; buffers (BatchNorm statistics) were saved at the batch's start.
- ``SKIP_PENDING``: the check failed and the action skips: the wrapped ``optimizer.step`` runs the closure (forward,
  backward, the check) and then leaves the step itself out, sets every gradient to ``None`` (with accumulation they
  would add up), and the state becomes ``SKIPPED``.
- ``SKIPPED``: the step was left out; a step-interval LR scheduler does not advance (epoch ones do). Under manual
  optimization the batch's later optimizer steps are left out too (a step may step several optimizers), and the LR
  schedules the user's ``training_step`` stepped in the batch are put back at its end.
- ``SCALER_SKIP``: fp16 loss scaling overflowed on purpose; the GradScaler skips the step itself and lowers its
  scale, and the LR scheduler does not advance either.

Under a GradScaler, a step the detector leaves out also leaves the scaler's scale as it was (the scaler saw the bad
gradients too and would lower it as for an overflow). The buffers are put back (:meth:`StepSkipper.restore_buffers`)
whatever the action, so a caught ``NonFiniteError``
leaves a model that still evaluates. Weights, optimizer state and the LR are untouched because no step ran.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.kit import PinsModules, offering
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.torch_compat import foreach_copy_, mark_scheduler_wrapped, scaler_tensors
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.repair import Repairs
from lightning_opkit.nan.report import NaNReport, NonFiniteError, amended, format_report, write_report

__all__ = ["Actions", "BatchState", "StepSkipper", "pinner", "with_found_inf"]

if TYPE_CHECKING:
    from lightning_opkit.core.logging import LogWriter
    from lightning_opkit.nan.dead import DeadWatch


def pinner(trainer: pl.Trainer) -> PinsModules | None:
    """The attached precision policy that pins a module to a dtype, if any."""
    return next(offering(trainer, PinsModules), None)


class Actions:
    """The run's faults and what was done about each: the reports, the steps skipped, the modules pinned.

    Args:
        action: ``"raise"``, ``"skip"``, ``"warn"`` or ``"stop"`` (see :class:`~lightning_opkit.NaNDetector`).
        max_consecutive_skips: with ``"skip"``, raise once this many steps in a row were skipped.
        repair: pin a precision fault's culprit to fp32 when the run goes on.
        skipper: the detector's step skipper (a skipped step is left out there).
        dead: the detector's dead-parameter watch, if any (its count is one of the counters written).

    Example:
        >>> from lightning_opkit.core.patch import Patches
        >>> actions = Actions("skip", 2, repair=False, skipper=StepSkipper(Patches()))
        >>> actions.goes_on, actions.skipped_steps, actions.reports
        (True, 0, [])
    """

    def __init__(self, action: str, max_consecutive_skips: int, repair: bool, skipper: StepSkipper,
                 dead: DeadWatch | None = None) -> None:
        self.action, self.max_consecutive_skips, self.repair = action, max_consecutive_skips, repair
        self._skipper, self._dead = skipper, dead
        #: where reports and counters are written: the detector's writer for the stage running (``None``: nowhere)
        self.writer: LogWriter | None = None
        #: every event of this run, typed
        self.reports: list[NaNReport] = []
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.repairs = Repairs()

    @property
    def goes_on(self) -> bool:
        """Whether the run goes on after one more fault: ``warn``, or ``skip`` under its limit."""
        return self.action == "warn" or (
            self.action == "skip" and self.consecutive_skips + 1 <= self.max_consecutive_skips)

    def counters(self) -> dict[str, float | None]:
        """The ``opkit/nan/*`` counters: events, skipped and consecutive skips, repairs, spikes, dead parameters."""
        return {"events": len(self.reports), "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "repairs": len(self.repairs.pinned),
                "spikes": sum(r.kind == "spike" for r in self.reports),
                "dead_parameters": len(self._dead.found) if self._dead is not None else None}

    def write(self, trainer: pl.Trainer, report: NaNReport | None = None) -> None:
        """Write the counters, and ``report`` if given, at the Trainer's step (nothing without a writer)."""
        if self.writer is None:
            return
        self.writer.scalars("opkit/nan", self.counters(), trainer.global_step)
        if report is not None:
            write_report(self.writer, report, trainer.global_step)

    def good_step(self) -> None:
        """A checked step was finite: the run of skipped steps is over."""
        self.consecutive_skips = 0

    def act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport, late: bool = False) -> None:
        """Act on a fault; ``late``: a step late (``decide="device"``), its update already left out on the device."""
        goes_on = self.goes_on
        report = self._kept(trainer, pl_module, report, goes_on)
        # The buffers the bad forward wrote are put back whatever the action: a caught NonFiniteError leaves a model
        # that still evaluates. A step late they were put back on the device; what goes back now is what the next
        # step's forward wrote, when the run ends here.
        if not late or not goes_on:
            self._skipper.restore_buffers()
        if self.action == "skip" and not goes_on:
            self.write(trainer, report)
            raise NonFiniteError(report, reason=f"NaNDetector skipped {self.consecutive_skips} steps in a row"
                                                f" (max_consecutive_skips={self.max_consecutive_skips}).")
        if self.action == "raise":
            self.write(trainer, report)
            raise NonFiniteError(report)
        if not late or self.action == "stop":
            # the optimizer step itself is left out (see StepSkipper); a step late, with stop, the next one is: the run
            # ends on the weights from before the bad batch
            self._skipper.leave_out_step()
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self.write(trainer, report)
        if self.action == "warn":
            # a fault that repeats is said once; each is counted in TensorBoard and the summary
            warn_once(format_report(report) + (" The optimizer step was skipped on the device (decide='device')."
                                               if late else " The optimizer step was skipped."),
                      key=("nan", report.origin.phase, report.origin.module), stacklevel=2)
        elif self.action == "stop":
            trainer.should_stop = True

    def collapsed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport) -> None:
        """A GradScaler's collapse (reported once): the scaler already skips its steps; raise, stop or warn."""
        report = self._kept(trainer, pl_module, report, self.action in ("skip", "warn"))
        self.write(trainer, report)
        if self.action == "raise":
            raise NonFiniteError(report, reason="The GradScaler's scale collapsed.")
        if self.action == "stop":
            trainer.should_stop = True
        else:
            warn_once(format_report(report), key=("nan", "scaler", report.origin.module), stacklevel=3)

    def _kept(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport,
              goes_on: bool) -> NaNReport:
        """The report amended (what loss scaling cannot do; the repair made, or a pin that did not hold), kept."""
        path, cause = report.origin.module, report.cause
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None and report.kind == "non_finite"
        repair = None
        if path and cause is not None and path not in self.repairs.pinned and self.repair and goes_on and \
                cause.cause == "precision":
            repair = self.repairs.pin(pl_module, path, pinner(trainer))
            facts_of(trainer).repairs[path] = "fp32"
        report = amended(dataclasses.replace(report, action=self.action), scaler=scaler,
                         pinned_before=bool(path) and path in self.repairs.pinned and repair is None, repair=repair)
        self.reports.append(report)
        return report

    def repairs_line(self) -> str | None:
        """The run summary's line on the modules pinned, if any."""
        if not self.repairs.pinned:
            return None
        return "  repaired (pinned to fp32 after a precision fault, repair=True): " + ", ".join(
            f"{path} at step {next((r.step for r in self.reports if r.repair and r.repair.startswith(path)), '-')}"
            for path in self.repairs.pinned)

    def state_dict(self) -> dict[str, Any]:
        """The reports (as dicts), the skip counters and the pins."""
        return {"events": [r.as_dict() for r in self.reports], "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "repairs": dict(self.repairs.pinned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back :meth:`state_dict` (pins are applied again at the fit's start)."""
        self.reports = [NaNReport.from_dict(e) for e in state.get("events", [])]
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        self.repairs.pinned = dict(state.get("repairs", {}))


# Leaving a step out: the skipper's batch states (see the module's docstring).


def with_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor, step: Any, **kwargs: Any) -> Any:
    """Run ``step(**kwargs)`` with ``found_inf`` handed to the optimizer, as a GradScaler hands it, and take it back.

    Args:
        optimizer: a fused optimizer (:func:`~lightning_opkit.core.torch_compat.takes_found_inf`).
        found_inf: a 0-d float32 tensor on the parameters' device: 1 leaves the update out, 0 applies it.
        step: the optimizer's own ``step``.
        kwargs: passed on to ``step``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=1.0, fused=True)
        >>> p.grad = torch.ones(2)
        >>> _ = with_found_inf(opt, torch.ones(()), opt.step)
        >>> p.tolist(), hasattr(opt, "found_inf")
        ([1.0, 1.0], False)
    """
    optimizer.found_inf, optimizer.grad_scale = found_inf, None  # type: ignore[attr-defined]
    try:
        return step(**kwargs)
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


class BatchState(enum.Enum):
    """Where the current batch stands with respect to its optimizer step."""

    UNCHECKED = "unchecked"
    CHECKING = "checking"
    SKIP_PENDING = "skip pending"
    SKIPPED = "skipped"
    SCALER_SKIP = "scaler skip"


class StepSkipper:
    """Wraps optimizers' ``step`` and the LightningModule's ``lr_scheduler_step`` so a batch's step can be left out.

    Args:
        patches: where the wrappers are recorded (restored by the owner).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=1.0)
        >>> skipper = StepSkipper(Patches())
        >>> skipper.wrap_optimizer(opt)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> skipper.leave_out_step()
        >>> before = model.weight.clone()
        >>> _ = opt.step(lambda: None)
        >>> torch.equal(before, model.weight), model.weight.grad, skipper.state.name
        (True, None, 'SKIPPED')
    """

    def __init__(self, patches: Patches) -> None:
        self._state = BatchState.UNCHECKED
        self._patches = patches
        self._schedulers: list[tuple[Any, torch.optim.Optimizer]] = []
        self._scaler: Any = None
        self._scaler_state: list[Tensor] = []
        self._schedules: list[tuple[Any, dict[str, Any], list[dict[str, Any]]]] = []
        self._buffers: list[Tensor] = []
        self._saved: list[Tensor] = []
        # with ``decide="device"``: this step's flag (a 0-d tensor), handed to the next optimizer step's ``found_inf``
        self._found_inf: Tensor | None = None

    @property
    def state(self) -> BatchState:
        """Where the current batch stands; changed only by this class's methods, each named for its transition."""
        return self._state

    @property
    def found_inf(self) -> Tensor | None:
        """With ``decide="device"``: the flag the next optimizer step takes as its ``found_inf`` (``None``: none)."""
        return self._found_inf

    def leave_out_step(self) -> None:
        """The check failed and the action skips: the optimizer step about to run is left out (``SKIP_PENDING``)."""
        self._state = BatchState.SKIP_PENDING

    def scaler_skips(self) -> None:
        """fp16 loss scaling overflowed: the GradScaler skips this step itself (``SCALER_SKIP``)."""
        self._state = BatchState.SCALER_SKIP

    def leave_out_where(self, bad: Tensor) -> None:
        """``decide="device"``: leave the next update out, and put the buffers back, where ``bad`` (a 0-d tensor) is 1.

        Both on the device, with no host sync: the fused optimizer reads ``bad`` as its ``found_inf``.
        """
        self._found_inf = bad
        self.restore_buffers_where(bad)

    def reset(self) -> None:
        """Back to no batch at all (a fit's end, an exception): nothing pending."""
        self._state, self._found_inf = BatchState.UNCHECKED, None

    @property
    def step_left_out(self) -> bool:
        """Whether this batch's optimizer step is (or will be) left out, by NaNDetector or by a GradScaler."""
        return self.state in (BatchState.SKIP_PENDING, BatchState.SKIPPED, BatchState.SCALER_SKIP)

    def begin_batch(self, checking: bool, save_buffers: bool) -> None:
        """At a batch's start: checked or not; save the buffers when a new optimizer step begins."""
        self._state = BatchState.CHECKING if checking else BatchState.UNCHECKED
        if checking and self._schedulers:
            self._save_schedules()
        if checking and self._scaler is not None:
            self._scaler_state = [t.clone() for t in scaler_tensors(self._scaler)]
        if checking and save_buffers and self._buffers:
            # One multi-tensor copy into storage allocated once, no host sync: BatchNorm statistics are written in
            # the forward, before any check can run.
            if len(self._saved) != len(self._buffers):
                self._saved = [torch.empty_like(b) for b in self._buffers]
            foreach_copy_(self._saved, self._buffers)

    def end_batch(self) -> None:
        """At a batch's end: under manual optimization, a left-out step's LR schedules put back."""
        skipped = self.state in (BatchState.SKIP_PENDING, BatchState.SKIPPED)
        if self._schedules and self.step_left_out:
            self._restore_schedules()
        if self._scaler_state and skipped:
            # the GradScaler saw the bad gradients too and lowered its scale: not for an overflow, so put it back
            foreach_copy_(scaler_tensors(self._scaler), self._scaler_state)
        self._schedules, self._scaler_state = [], []

    def watch_buffers(self, buffers: list[Tensor]) -> None:
        """The buffers a skipped step puts back."""
        self._buffers = [b for b in buffers if not b.is_sparse]
        self._saved = []

    def restore_buffers(self) -> None:
        """Put back the buffers saved at the start of this optimizer step."""
        if self._saved:
            with torch.no_grad():
                foreach_copy_(self._buffers, self._saved)

    def restore_buffers_where(self, bad: Tensor) -> None:
        """Put back the saved buffers where ``bad`` (a 0-d tensor) is set, on the device: no host sync."""
        if self._saved:
            put_back = bad.bool()
            with torch.no_grad():
                for buffer, saved in zip(self._buffers, self._saved):
                    buffer.copy_(torch.where(put_back, saved, buffer))

    def wrap_scheduler_step(self, pl_module: Any, interval_of: Callable[[Any], str]) -> None:
        """Patch ``pl_module.lr_scheduler_step`` so a left-out step does not advance a per-step schedule.

        Args:
            pl_module: the LightningModule.
            interval_of: scheduler -> ``"step"`` or ``"epoch"``.
        """
        original = pl_module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Any = None) -> None:
            if self.step_left_out and interval_of(scheduler) == "step":
                return None
            return original(scheduler, metric)

        self._patches.set(pl_module, "lr_scheduler_step", lr_scheduler_step)

    def watch_scaler(self, scaler: Any) -> None:
        """A GradScaler (or ``None``) whose scale and growth count a step left out by the detector puts back.

        Args:
            scaler: the precision plugin's ``torch.amp.GradScaler``.
        """
        self._scaler, self._scaler_state = scaler, []

    def watch_schedulers(self, schedulers: list[tuple[Any, torch.optim.Optimizer]]) -> None:
        """Under manual optimization, where ``training_step`` steps the LR schedulers: a left-out batch's are put back.

        Their state and their optimizers' hyperparameters are saved at a checked batch's start and restored at its
        end if its step was left out. (Patching ``scheduler.step`` instead would put the patch into the scheduler's
        ``state_dict``, which a checkpoint cannot pickle.)

        Args:
            schedulers: ``(scheduler, its optimizer)`` pairs.
        """
        self._schedulers = list(schedulers)

    def _save_schedules(self) -> None:
        self._schedules = [(scheduler, copy.deepcopy(scheduler.state_dict()),
                            [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups])
                           for scheduler, opt in self._schedulers]

    def _restore_schedules(self) -> None:
        for (scheduler, state, groups), (_, opt) in zip(self._schedules, self._schedulers, strict=True):
            scheduler.load_state_dict(state)
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Patch ``optimizer.step``: the closure runs first, then the step unless it is to be left out."""
        step = optimizer.step

        # The skip is decided inside the closure (on_before_optimizer_step), after backward and before gradient
        # clipping. Running the closure first lets the step itself be left out, rather than relying on every
        # optimizer to ignore parameters without gradients (weight decay would still move them).
        def step_now(**kwargs: Any) -> Any:
            found_inf, self._found_inf = self._found_inf, None
            return step(**kwargs) if found_inf is None else with_found_inf(optimizer, found_inf, step, **kwargs)

        def skippable_step(closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:  # a GradScaler's step, after the precision plugin ran the closure itself
                return self._leave_out(optimizer) if self._take_pending() else step_now(**kwargs)
            with torch.enable_grad():
                result = closure()
            if self._take_pending():
                self._leave_out(optimizer)
                return result
            pending = [result]

            def closure_once_more() -> Any:
                # The optimizer's own call gets the result already computed; LBFGS's later calls rerun the closure.
                return pending.pop() if pending else closure()

            return step_now(closure=closure_once_more, **kwargs)

        mark_scheduler_wrapped(step, skippable_step)
        self._patches.set(optimizer, "step", skippable_step)

    def _take_pending(self) -> bool:
        if self.state is BatchState.SKIP_PENDING:
            self._state, self._found_inf = BatchState.SKIPPED, None
            return True
        # a manually optimized batch's later steps (another optimizer's) go with the one left out
        return self.state is BatchState.SKIPPED

    @staticmethod
    def _leave_out(optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None
