"""NaNDetector: find the first non-finite value in forward, backward or loss, name its module, lose nothing.

The callback orchestrates Trainer-free parts: the per-step check (:mod:`~lightning_opkit.nan.check`), the step
skipper and its per-batch state (:mod:`~lightning_opkit.nan.skip`: what happens on a skipped step), localization
(:mod:`~lightning_opkit.nan.locate`), cause diagnosis (:mod:`~lightning_opkit.nan.cause`) and the typed report
(:mod:`~lightning_opkit.nan.report`).

Logged (rank zero): ``opkit/nan/events``, ``opkit/nan/skipped_steps``, ``opkit/nan/consecutive_skips`` (scalars, at
each event and each epoch's end), ``opkit/nan/report`` (the report and its fields) and ``opkit/nan/cause`` (text).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.checks import check_bools, check_choice, check_globs, check_int, check_positive
from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.kit import PinsModules, offering
from lightning_opkit.core.ranks import Ranks
from lightning_opkit.core.replay import rng_state, set_rng_state
from lightning_opkit.core.select import resolve_modules
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.check import check, flags
from lightning_opkit.nan.dead import DeadWatch
from lightning_opkit.nan.device import HostCopy, as_of_step, takes_found_inf
from lightning_opkit.nan.log import write_dead, write_report
from lightning_opkit.nan.repair import Repairs
from lightning_opkit.nan.replays import MicroBatch, Replays
from lightning_opkit.nan.report import (
    NaNReport,
    NonFiniteError,
    Origin,
    amended,
    format_report,
)
from lightning_opkit.nan.scaler import ScaleWatch, collapse_cause
from lightning_opkit.nan.skip import BatchState, StepSkipper
from lightning_opkit.nan.spike_report import Spikes

__all__ = ["NaNDetector", "NonFiniteError", "format_report"]

_ACTIONS = ("raise", "skip", "warn", "stop")
_DECIDE = ("host", "device")


def _pinner(trainer: pl.Trainer) -> PinsModules | None:
    """The attached precision policy that pins a module to a dtype, if any."""
    return next(offering(trainer, PinsModules), None)


def _check_device_decision(trainer: pl.Trainer) -> None:
    """``decide="device"`` needs optimizers that take ``found_inf``, and no GradScaler of its own deciding skips."""
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError("NaNDetector(decide='device') cannot share the optimizer's found_inf with this run's"
                         f" GradScaler (precision={trainer.precision!r}): use decide='host', or bf16")
    if not trainer.lightning_module.automatic_optimization:
        raise ValueError("NaNDetector(decide='device') needs automatic optimization (it hands the optimizer step its"
                         " found_inf): this LightningModule optimizes manually; use decide='host'")
    for optimizer in trainer.optimizers:
        if not takes_found_inf(optimizer):
            raise ValueError(f"NaNDetector(decide='device') needs an optimizer that leaves an update out on the device"
                             f" (found_inf): {type(optimizer).__name__} here is not fused. Pass fused=True (torch's"
                             " Adam, AdamW, SGD, Adagrad), or use decide='host'")


def _check_args(action: Any, every_n_steps: Any, modules: Any, max_consecutive_skips: Any, spike_zscore: Any,
                spike_window: Any, dead_after: Any, decide: Any, **flags: Any) -> None:
    """Raise for the first bad ``NaNDetector`` argument, naming it, its value and what is valid."""
    check_choice("action", action, _ACTIONS)
    check_bools(**flags)
    if not (flags["check_forward"] or flags["check_backward"] or flags["check_loss"]):
        raise ValueError("At least one of `check_forward`, `check_backward`, `check_loss` must be True")
    check_int("every_n_steps", every_n_steps, 0)
    check_int("max_consecutive_skips", max_consecutive_skips, 1)
    check_globs("modules", modules)
    check_int("spike_window", spike_window, 2)
    check_positive("spike_zscore", spike_zscore, "such as 6.0, or None")
    check_int("dead_after", dead_after, 1, optional=True)
    check_choice("decide", decide, _DECIDE)
    if decide == "device" and spike_zscore is not None:
        raise ValueError(f"NaNDetector(decide='device') reads a step's values one step late, too late to leave a"
                         f" spike's update out: spike_zscore={spike_zscore!r} needs decide='host'")


@dataclass
class _Late:
    """A checked step whose flags were left on the device (``decide="device"``), to be read at the next step."""

    pending: list[MicroBatch]
    found: HostCopy
    step: int
    epoch: int


def _scaler_collapsed(trainer: pl.Trainer, pl_module: pl.LightningModule, detector: NaNDetector,
                      pending: list[MicroBatch], scale: float) -> None:
    """Report the GradScaler's collapse once, with where the gradients first went non-finite at this scale."""
    ranks, resume_rng = Ranks(pl_module.device), rng_state()
    try:
        seen = detector._replays.first_seen(trainer, pl_module, pending, ranks, scale=scale)
    finally:
        set_rng_state(resume_rng)
    origin = seen[1] if seen is not None else Origin(phase="backward", module=None)
    cause = collapse_cause(detector._scale_watch.describe(scale), origin.module)
    report = detector._amended(trainer, pl_module, detector._replays.new_report(
        trainer, pending[-1].batch_idx if pending else -1, origin, cause, 0), detector.action in ("skip", "warn"))
    detector.reports.append(report)
    detector._log(trainer, report)
    if detector.action == "raise":
        raise NonFiniteError(report, reason="The GradScaler's scale collapsed.")
    if detector.action == "stop":
        trainer.should_stop = True
    else:
        warn_once(format_report(report), key=("nan", "scaler", report.origin.module), stacklevel=3)


def _name_dead(detector: NaNDetector, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Name, once, the parameters and experts whose gradient stopped: a warning, a table, a scalar."""
    watch = detector._dead
    new = watch.newly_dead(pl_module) if watch is not None else []
    if not new or watch is None:
        return
    warning = watch.warning(new)
    if warning is not None:
        warn_once(warning, stacklevel=3)
    if detector._writer is not None:
        detector._log_counters(trainer)
        write_dead(detector._writer, watch.found, trainer.global_step)


def _check_inputs(detector: NaNDetector, trainer: pl.Trainer, pl_module: pl.LightningModule,
                  pending: list[MicroBatch], optimizer: torch.optim.Optimizer) -> tuple[
                      list[Tensor], list[Tensor], torch.device, Callable[[Tensor | None], Tensor] | None]:
    """What a checked step checks, for :func:`.check.check` and :func:`.check.flags` alike.

    The micro-batches' losses, the gradients (when ``check_backward``), the device, and the dead-parameter flag (when
    watched).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grads = [p.grad for p in params if p.grad is not None] if detector.check_backward else []
    dead = None if detector._dead is None else functools.partial(detector._dead.flag, params, step=trainer.global_step)
    return [m.loss for m in pending if m.loss is not None], grads, pl_module.device, dead


def _decide_on_device(detector: NaNDetector, trainer: pl.Trainer, pl_module: pl.LightningModule,
                      optimizer: torch.optim.Optimizer) -> None:
    """Read the last checked step's flags (copied long ago), then leave this step's flags on the device."""
    _settle(detector, trainer, pl_module)
    if detector._skipper.state is not BatchState.CHECKING:
        return
    pending, detector._pending = detector._pending, []
    found, _, _ = flags(*_check_inputs(detector, trainer, pl_module, pending, optimizer))
    bad = found[:2].amax()
    detector._skipper.found_inf = bad  # the fused optimizer leaves the update out where it is 1
    detector._skipper.restore_buffers_where(bad)
    detector._late = _Late(pending, HostCopy(found), trainer.global_step, trainer.current_epoch)


def _settle(detector: NaNDetector, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """With ``decide="device"``: read a checked step's flags, and report and act on a fault, a step late."""
    late, detector._late = detector._late, None
    if late is None:
        return
    loss_bad, grad_bad, _, _, flagged = late.found.read()
    if flagged > 0:
        _name_dead(detector, trainer, pl_module)
    if not (loss_bad > 0 or grad_bad > 0):
        detector.consecutive_skips = 0
        return
    # The weights are still those the bad step ran on: its update was left out on the device.
    with as_of_step(trainer, late.step):
        report = detector._replays.report(trainer, pl_module, late.pending, loss_bad > 0, None)
        detector._act(trainer, pl_module, dataclasses.replace(report, epoch=late.epoch), late=True)


class NaNDetector(OpkitCallback):
    """Detect NaN/Inf in the loss, the forward pass and the backward pass; name the first module that produced it.

    Every checked step costs one fused check of the loss and all gradients and one host sync, before the optimizer
    step (none with ``decide="device"``). Only when that check fails is the step's batch replayed (same weights, same
    RNG state) with hooks on every module, to name the module whose output went non-finite from finite inputs (or
    whose backward produced a non-finite input-gradient, or the parameter whose gradient is non-finite).

    Args:
        action: ``"raise"`` a :class:`NonFiniteError`; ``"skip"`` the optimizer step (weights, optimizer state and
            step-interval LR schedulers untouched) and go on, raising after ``max_consecutive_skips`` skips in a row;
            ``"warn"``: like skip, with a warning each time and no limit; ``"stop"``: skip the step, then end
            training gracefully.
        check_forward: name modules whose forward output went non-finite.
        check_backward: check gradients, and name the module or parameter whose gradient went non-finite.
        check_loss: check the loss.
        every_n_steps: check one optimizer step in this many (1 = every step); 0 = off (the callback attaches
            nothing, as with ``enabled=False``).
        modules: globs over ``pl_module.named_modules()`` names to localize among; ``None`` = every module.
        max_consecutive_skips: with ``action="skip"``, raise once this many steps in a row were skipped.
        repair: when a fault's cause is ``precision`` and the action lets the run go on (``"skip"``, ``"warn"``), pin
            its culprit module to fp32 from the next step on (:mod:`~lightning_opkit.nan.repair`: through an attached
            PrecisionPolicy, else by autocast off in it or, with 16-bit weights, fp32 copies of them), and say so in
            the report, ``opkit/nan/repairs`` and the run summary. A pin that does not hold (the module faults again
            in fp32) is not retried. ``False``: report and act only.
        spike_zscore: also treat a step as a fault when its loss, or its global gradient norm, is more than this
            many deviations above the recent good steps (:mod:`~lightning_opkit.nan.spike`: log space, the median
            of the last 10 good steps, the MAD of step-to-step differences); reported with ``kind="spike"``, where it
            starts and why (:mod:`~lightning_opkit.nan.spike_report`). ``None``: spikes are not looked for.
        spike_window: good steps the spike statistics keep.
        dead_after: name once, with their module, the stepped parameters (and experts of fused MoE weights) that had
            no gradient, or an all-zero one, over this many checked steps in a row (:mod:`~lightning_opkit.nan.dead`);
            ``None``: not watched.
        decide: ``"host"``: the checked step's flags are read on the host before ``optimizer.step`` (one sync).
            ``"device"``: no sync: a fused optimizer (``fused=True``) leaves a bad step's update out on the device,
            and the report and the action come one step late (:mod:`~lightning_opkit.nan.device`: a step-interval
            LR schedule then advances on the skipped step). Needs a fused optimizer, no GradScaler, no
            ``spike_zscore``.
        enabled: attach the callback; ``False`` (or its area, ``nan``, in the environment variable
            ``OPKIT_DISABLE``) leaves it attaching nothing, said once at setup.
        log_dir: where to write opkit's TensorBoard files when the Trainer has no TensorBoard logger (by default none
            then: ``logger=False`` writes no file).

    Example:
        >>> trainer = pl.Trainer(callbacks=[NaNDetector(action="skip", spike_zscore=6.0)], logger=False)
        >>> NaNDetector(action="ignore")
        Traceback (most recent call last):
            ...
        ValueError: Expected `action` to be one of ['raise', 'skip', 'warn', 'stop'], but got 'ignore'
    """

    area = "nan"

    def __init__(
        self,
        action: Literal["raise", "skip", "warn", "stop"] = "raise",
        check_forward: bool = True,
        check_backward: bool = True,
        check_loss: bool = True,
        every_n_steps: int = 1,
        modules: Optional[list[str]] = None,
        max_consecutive_skips: int = 10,
        repair: bool = True,
        spike_zscore: Optional[float] = None,
        spike_window: int = 100,
        dead_after: Optional[int] = None,
        decide: Literal["host", "device"] = "host",
        enabled: bool = True,
        log_dir: Optional[str] = None,
    ) -> None:
        super().__init__(enabled, log_dir, off="every_n_steps=0" if every_n_steps == 0 else None)
        _check_args(action, every_n_steps, modules, max_consecutive_skips, spike_zscore, spike_window, dead_after,
                    decide, check_forward=check_forward, check_backward=check_backward, check_loss=check_loss,
                    repair=repair)
        self.action = action
        self.check_forward = check_forward
        self.check_backward = check_backward
        self.check_loss = check_loss
        self.every_n_steps = every_n_steps
        self.modules = list(modules) if modules is not None else None
        self.max_consecutive_skips = max_consecutive_skips
        self.repair = repair
        self.spike_zscore = None if spike_zscore is None else float(spike_zscore)
        self.spike_window = spike_window

        #: every event of this run, typed; :attr:`events` is their dict view
        self.reports: list[NaNReport] = []
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self._replays = Replays(check_forward, check_backward, check_loss, action)
        self._pending: list[MicroBatch] = []
        self._stepped = False  # an optimizer step was checked on ``_pending`` in this batch
        self._skipper = StepSkipper(self._patches)
        self._repairs = Repairs()
        self._scale_watch = ScaleWatch()
        self._spikes = Spikes(self.spike_zscore or math.inf, spike_window)
        self.dead_after = dead_after
        self._dead = DeadWatch(dead_after) if dead_after is not None else None
        self.decide = decide
        self._late: _Late | None = None

    @property
    def events(self) -> list[dict[str, Any]]:
        """Every event of this run as a dict (step, epoch, batch_idx, rank, phase, module, ..., cause, action)."""
        return [r.as_dict() for r in self.reports]

    @property
    def batch_state(self) -> BatchState:
        """Where the current batch stands: unchecked, checking, skip pending, skipped, or skipped by a GradScaler."""
        return self._skipper.state

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(action=self.action, every_n_steps=self.every_n_steps)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"events": self.events, "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                "repairs": dict(self._repairs.pinned), "spikes": self._spikes.state_dict(),
                "dead": self._dead.state_dict() if self._dead is not None else {}}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self._late is not None:
            # decide="device": a checkpoint between a checked step and the next carries that step's fault too (the
            # read is the checkpoint's own sync; its weights are already without the bad update)
            _settle(self, trainer, pl_module)
            checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.reports = [NaNReport.from_dict(e) for e in state_dict.get("events", [])]
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        self.consecutive_skips = int(state_dict.get("consecutive_skips", 0))
        self._repairs.pinned = dict(state_dict.get("repairs", {}))  # pinned again at the fit's start
        self._spikes.load_state_dict(state_dict.get("spikes", {}))
        if self._dead is not None:
            self._dead.load_state_dict(state_dict.get("dead", {}))

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """One chart: events, skipped steps, consecutive skips."""
        return {"opkit nan": {"non-finite events and skipped steps": [
            "Multiline", [r"opkit/nan/events", r"opkit/nan/skipped_steps", r"opkit/nan/consecutive_skips",
                          r"opkit/nan/repairs", r"opkit/nan/spikes"]]}}

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        faults = [r for r in self.reports if r.kind == "non_finite"]
        line = f"NaN/Inf: {len(faults)} event(s), {self.skipped_steps} skipped step(s) (action={self.action!r}" + (
            ", decided on the device: read a step late)" if self.decide == "device" else ")")
        if faults:
            first = faults[0]
            line += f"; first at step {first.step}: {first.origin.phase} in {first.origin.module or '<the loss>'!r}"
        lines = [line]
        lines += [line for line in (self._spikes.summary_line(self.reports) if self.spike_zscore is not None else "",
                                    self._dead.summary_line() if self._dead is not None else "") if line]
        if self._repairs.pinned:
            lines.append("  repaired (pinned to fp32 after a precision fault, repair=True): " + ", ".join(
                f"{path} at step {next((r.step for r in self.reports if r.repair and r.repair.startswith(path)), '-')}"
                for path in self._repairs.pinned))
        return lines

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._detach()
        self._replays.hooked = (resolve_modules(pl_module, self.modules, owner="NaNDetector")
                                if self.modules is not None else list(pl_module.named_modules()))
        self._skipper.watch_buffers(list(pl_module.buffers()))
        if self.spike_zscore is not None:
            self._spikes.start()
        if self._dead is not None:
            self._dead.start(pl_module)
        self._open_writer(trainer, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Patched only now, after Lightning has validated the schedulers against the user's own methods.
        def interval_of(scheduler: Any) -> str:
            return next((c.interval for c in trainer.lr_scheduler_configs if c.scheduler is scheduler), "step")

        if pl_module.automatic_optimization:
            self._skipper.wrap_scheduler_step(pl_module, interval_of)
        else:  # the user's training_step steps the schedulers itself
            self._skipper.watch_schedulers([(c.scheduler, c.scheduler.optimizer) for c in trainer.lr_scheduler_configs])
        if self.decide == "device":
            _check_device_decision(trainer)
        for optimizer in trainer.optimizers:
            self._skipper.wrap_optimizer(optimizer)
        self._skipper.watch_scaler(getattr(trainer.precision_plugin, "scaler", None))
        self._repairs.apply_all(pl_module, _pinner(trainer))  # a resumed run keeps its pins
        facts_of(trainer).repairs.update(self._repairs.pinned)

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        self._pending.clear()
        self._stepped = False
        self._late = None
        self._skipper.state, self._skipper.found_inf = BatchState.UNCHECKED, None
        self._skipper.watch_schedulers([])
        self._skipper.watch_scaler(None)
        self._repairs.release()

    # the cheap per-step path: hooks -> check

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._stepped:
            # The last optimizer step's micro-batches are done with. They are kept until now because a manually
            # optimized step may step several optimizers, each checked on the batch.
            self._pending.clear()
            self._stepped = False
        checking = trainer.global_step % self.every_n_steps == 0
        self._skipper.begin_batch(checking, save_buffers=not self._pending)
        if checking:
            # References only: the batch and RNG state are what a replay needs to reproduce this micro-batch.
            self._pending.append(MicroBatch(batch, batch_idx, rng_state()))
        else:
            self._pending.clear()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._skipper.end_batch()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._skipper.state is BatchState.CHECKING and self._pending:
            # a copy: under CUDA graphs (mode="reduce-overhead") the loss lives in memory the next replay reuses
            loss = loss.detach().clone()
            micro = self._pending[-1]
            # a manually optimized step may call manual_backward more than once: their sum is what it trained on
            micro.loss = loss if micro.loss is None else micro.loss + loss

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.decide == "device":
            _decide_on_device(self, trainer, pl_module, optimizer)
            return
        if self._skipper.state is not BatchState.CHECKING:
            return
        pending, self._stepped = list(self._pending), True
        checked = check(*_check_inputs(self, trainer, pl_module, pending, optimizer))
        if checked.extra:
            _name_dead(self, trainer, pl_module)
        loss_bad, grad_bad = checked.loss_bad, checked.grad_bad
        scores = self._spikes.watch.scores(checked.values) if self._spikes.watch is not None else (0.0, 0.0)
        spiked = None if loss_bad or grad_bad else self._spikes.which_spiked(*scores)
        if spiked is not None:
            self._act(trainer, pl_module, self._replays.spike_report(trainer, pl_module, self._spikes, pending, checked,
                                                                     spiked, optimizer))
            return
        if not (loss_bad or grad_bad):
            self.consecutive_skips = 0
            self._scale_watch.healthy()
            if self._spikes.watch is not None:
                self._spikes.healthy(checked.values, checked.norms, pending[-1] if pending else None, scores)
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and grad_bad and not loss_bad and not self._replays.forward_fault(trainer, pl_module,
                                                                                                 pending):
            # fp16 loss scaling overflows on purpose; the GradScaler skips that step and lowers the scale. Its scale
            # is read (a sync) only on such a step, already found non-finite.
            self._skipper.state = BatchState.SCALER_SKIP
            scale = float(scaler.get_scale())
            if self._scale_watch.skipped_step(scale):
                _scaler_collapsed(trainer, pl_module, self, pending, scale)
            return
        self._act(trainer, pl_module, self._replays.report(trainer, pl_module, pending, loss_bad, optimizer))

    # the slow path: act

    def _act(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport, late: bool = False) -> None:
        """Act on a fault; ``late``: a step late (``decide="device"``), its update already left out on the device."""
        goes_on = self.action == "warn" or (
            self.action == "skip" and self.consecutive_skips + 1 <= self.max_consecutive_skips)
        report = self._amended(trainer, pl_module, report, goes_on)
        self.reports.append(report)
        # The buffers the bad forward wrote are put back whatever the action: a caught NonFiniteError leaves a model
        # that still evaluates. A step late they were put back on the device; what goes back now is what the next
        # step's forward wrote, when the run ends here.
        if not late or not goes_on:
            self._skipper.restore_buffers()
        if self.action == "skip" and self.consecutive_skips + 1 > self.max_consecutive_skips:
            self._log(trainer, report)
            raise NonFiniteError(report, reason=f"NaNDetector skipped {self.consecutive_skips} steps in a row"
                                                f" (max_consecutive_skips={self.max_consecutive_skips}).")
        if self.action == "raise":
            self._log(trainer, report)
            raise NonFiniteError(report)
        if not late or self.action == "stop":
            # the optimizer step itself is left out (see skip.py); a step late, with stop, the next one is: the run
            # ends on the weights from before the bad batch
            self._skipper.state = BatchState.SKIP_PENDING
        self.skipped_steps += 1
        self.consecutive_skips += 1
        self._log(trainer, report)
        if self.action == "warn":
            # a fault that repeats is said once; each is counted in TensorBoard and the summary
            warn_once(format_report(report) + (" The optimizer step was skipped on the device (decide='device')."
                                               if late else " The optimizer step was skipped."),
                      key=("nan", report.origin.phase, report.origin.module), stacklevel=2)
        elif self.action == "stop":
            trainer.should_stop = True

    def _amended(self, trainer: pl.Trainer, pl_module: pl.LightningModule, report: NaNReport,
                 goes_on: bool) -> NaNReport:
        """The report with what loss scaling cannot do, and the repair: made, or a pin that did not hold."""
        path, cause = report.origin.module, report.cause
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None and report.kind == "non_finite"
        repair = None
        if path and cause is not None and path not in self._repairs.pinned and self.repair and goes_on and \
                cause.cause == "precision":
            repair = self._repairs.pin(pl_module, path, _pinner(trainer))
            facts_of(trainer).repairs[path] = "fp32"
        return amended(report, scaler=scaler, pinned_before=bool(path) and path in self._repairs.pinned and
                       repair is None, repair=repair)

    # what gets logged where

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _settle(self, trainer, pl_module)  # the epoch's last checked step, with decide="device"
        # A clean run shows flat zeros in TensorBoard rather than no NaN tags at all.
        self._log_counters(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _settle(self, trainer, pl_module)

    def _log(self, trainer: pl.Trainer, report: NaNReport) -> None:
        if self._writer is not None:
            self._log_counters(trainer)
            write_report(self._writer, report, trainer.global_step)

    def _log_counters(self, trainer: pl.Trainer) -> None:
        self._scalars("opkit/nan", {"events": len(self.reports), "skipped_steps": self.skipped_steps,
                                    "consecutive_skips": self.consecutive_skips,
                                    "repairs": len(self._repairs.pinned),
                                    "spikes": sum(r.kind == "spike" for r in self.reports),
                                    "dead_parameters": len(self._dead.found) if self._dead else None},
                     trainer.global_step)
