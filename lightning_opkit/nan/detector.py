"""NaNDetector: find the first non-finite value in forward, backward or loss, name its module, lose nothing.

The callback orchestrates Trainer-free parts: the per-step check (:mod:`~lightning_opkit.nan.check`), the replays
that find where a fault starts and why (:mod:`~lightning_opkit.nan.replays`), what is done about it, the step skipper
and its per-batch state included (:mod:`~lightning_opkit.nan.actions`: what happens on a skipped step), and the typed
report (:mod:`~lightning_opkit.nan.report`).

Logged (rank zero): ``opkit/nan/events``, ``opkit/nan/skipped_steps``, ``opkit/nan/consecutive_skips`` (scalars, at
each event and each epoch's end), ``opkit/nan/report`` (the report and its fields) and ``opkit/nan/cause`` (text).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.checks import check_bools, check_choice, check_globs, check_int, check_positive
from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.replay import rng_state
from lightning_opkit.core.select import resolve_modules
from lightning_opkit.nan.actions import Actions, BatchState, StepSkipper, pinner
from lightning_opkit.nan.check import FiniteOnly, check, flags, outcome
from lightning_opkit.nan.dead import DeadWatch, write_dead
from lightning_opkit.nan.device import DeviceDecision, check_device_decision
from lightning_opkit.nan.replays import MicroBatch, Replays
from lightning_opkit.nan.report import NaNReport, NonFiniteError, format_report
from lightning_opkit.nan.scaler import ScaleWatch
from lightning_opkit.nan.spike_report import Spikes, report_spike

__all__ = ["NaNDetector", "NonFiniteError", "format_report"]

_ACTIONS = ("raise", "skip", "warn", "stop")
_DECIDE = ("host", "device")


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


class NaNDetector(OpkitCallback):
    """Detect NaN/Inf in the loss, the forward pass and the backward pass; name the first module that produced it.

    Every checked step costs one multi-tensor check of the loss and all gradients and one host sync, before the
    optimizer step (none with ``decide="device"``). Only when that check fails is the step's batch replayed (same
    weights, same RNG state) with hooks on every module, to name the module whose output went non-finite from finite
    inputs (or whose backward produced a non-finite input-gradient, or the parameter whose gradient is non-finite).

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
        self.check_forward = check_forward
        self.check_backward = check_backward
        self.check_loss = check_loss
        self.every_n_steps = every_n_steps
        self.modules = list(modules) if modules is not None else None
        self.spike_zscore = None if spike_zscore is None else float(spike_zscore)
        self.spike_window = spike_window

        self._replays = Replays(check_forward, check_backward, check_loss)
        self._pending: list[MicroBatch] = []
        self._stepped = False  # an optimizer step was checked on ``_pending`` in this batch
        self._skipper = StepSkipper(self._patches)
        self._scale_watch = ScaleWatch()
        self._spikes = Spikes(self.spike_zscore or math.inf, spike_window)
        self.dead_after = dead_after
        self._dead = DeadWatch(dead_after) if dead_after is not None else None
        self._actions = Actions(action, max_consecutive_skips, repair, self._skipper, self._dead)
        self.decide = decide
        self._device = DeviceDecision()
        # what every checked step reads, fixed for a fit: set at its start (the hooks run with cold caches, where each
        # Lightning property read costs microseconds)
        self._quick = FiniteOnly()
        self._model_device = torch.device("cpu")
        self._scaler: Any = None

    # What is done about a fault is held once, by the actions part that does it: set here, it changes there.

    @property
    def action(self) -> str:
        """``"raise"``, ``"skip"``, ``"warn"`` or ``"stop"``."""
        return self._actions.action

    @action.setter
    def action(self, value: str) -> None:
        self._actions.action = value

    @property
    def max_consecutive_skips(self) -> int:
        """With ``action="skip"``, how many steps in a row may be skipped before it raises."""
        return self._actions.max_consecutive_skips

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: int) -> None:
        self._actions.max_consecutive_skips = value

    @property
    def repair(self) -> bool:
        """Whether a precision fault's culprit is pinned to fp32 from the next step on."""
        return self._actions.repair

    @repair.setter
    def repair(self, value: bool) -> None:
        self._actions.repair = value

    @property
    def reports(self) -> list[NaNReport]:
        """Every event of this run, typed; :attr:`events` is their dict view."""
        return self._actions.reports

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps this callback left out in this run."""
        return self._actions.skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Steps left out in a row, up to now."""
        return self._actions.consecutive_skips

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
        return {**self._actions.state_dict(), "spikes": self._spikes.state_dict(),
                "dead": self._dead.state_dict() if self._dead is not None else {}}

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self._device.late is not None:
            # decide="device": a checkpoint between a checked step and the next carries that step's fault too (the
            # read is the checkpoint's own sync; its weights are already without the bad update)
            self._settle(trainer, pl_module)
            checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._actions.load_state_dict(state_dict)
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
        repaired = self._actions.repairs_line()
        return lines + ([repaired] if repaired else [])

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._detach()
        self._replays.hooked = (resolve_modules(pl_module, self.modules, owner="NaNDetector")
                                if self.modules is not None else list(pl_module.named_modules()))
        self._replays.join(trainer)
        self._skipper.watch_buffers(list(pl_module.buffers()))
        if self.spike_zscore is not None:
            self._spikes.start()
        if self._dead is not None:
            self._dead.start(pl_module)
        self._actions.writer = self._open_writer(trainer, stage)

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
            check_device_decision(trainer)
        for optimizer in trainer.optimizers:
            self._skipper.wrap_optimizer(optimizer)
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._skipper.watch_scaler(self._scaler)
        self._quick, self._model_device = FiniteOnly(), pl_module.device
        self._actions.repairs.apply_all(pl_module, pinner(trainer))  # a resumed run keeps its pins
        facts_of(trainer).repairs.update(self._actions.repairs.pinned)

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        self._pending.clear()
        self._stepped = False
        self._device.late = None
        self._skipper.reset()
        self._skipper.watch_schedulers([])
        self._skipper.watch_scaler(None)
        self._scaler = None
        self._actions.repairs.release()
        self._actions.writer = None

    # the cheap per-step path: hooks -> check

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._stepped:
            # The last optimizer step's micro-batches are done with. They are kept until now because a manually
            # optimized step may step several optimizers, each checked on the batch.
            self._pending.clear()
            self._stepped = False
        checking = self.every_n_steps == 1 or trainer.global_step % self.every_n_steps == 0
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
            self._settle(trainer, pl_module)  # the last checked step's flags, copied long ago
            if self._skipper.state is BatchState.CHECKING:
                pending, self._pending = self._pending, []
                found, _, _ = flags(*self._inputs(trainer, pl_module, pending, optimizer))
                self._device.leave(found, self._skipper, pending, trainer.global_step, trainer.current_epoch)
            return
        if self._skipper.state is not BatchState.CHECKING:
            return
        pending, self._stepped = list(self._pending), True
        # without spike scores the check needs no norms: on CPU only whether anything is non-finite is asked
        checked = check(*self._inputs(trainer, pl_module, pending, optimizer), norms=self._spikes.watch is not None,
                        quick=self._quick)
        if checked.dead:
            self._name_dead(trainer, pl_module)
        verdict = outcome(checked, self._spikes.judge if self._spikes.watch is not None else None,
                          self._scaler, lambda: self._replays.forward_fault(trainer, pl_module, pending))
        if verdict.kind == "healthy":
            self._actions.good_step()
            self._scale_watch.healthy()
            if self._spikes.watch is not None:
                self._spikes.healthy(checked.values, checked.norms, pending[-1] if pending else None, verdict.scores)
        elif verdict.kind == "spike":
            report = report_spike(self._replays, trainer, pl_module, self._spikes, pending, checked,
                                  str(verdict.spiked), optimizer)
            self._actions.act(trainer, pl_module, report)
        elif verdict.kind == "scaler overflow":
            # the GradScaler skips the step and lowers its scale
            self._skipper.scaler_skips()
            if verdict.scale is not None and self._scale_watch.skipped_step(verdict.scale):
                self._actions.collapsed(trainer, pl_module, self._replays.collapse_report(
                    trainer, pl_module, pending, verdict.scale, self._scale_watch.describe(verdict.scale)))
        else:
            self._actions.act(trainer, pl_module, self._replays.report(trainer, pl_module, pending, checked.loss_bad,
                                                                       optimizer))

    def _inputs(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: list[MicroBatch],
                optimizer: torch.optim.Optimizer) -> tuple[list[Tensor], list[Tensor], torch.device,
                                                           Callable[[Tensor | None], Tensor] | None]:
        """What a checked step checks (:func:`.check.check`, :func:`.check.flags`): losses, gradients, dead flag."""
        grads = [grad for g in optimizer.param_groups for p in g["params"] if (grad := p.grad) is not None] if (
            self.check_backward) else []
        dead = None if self._dead is None else functools.partial(
            self._dead.flag, [p for g in optimizer.param_groups for p in g["params"]], step=trainer.global_step)
        return [m.loss for m in pending if m.loss is not None], grads, self._model_device, dead

    def _settle(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With ``decide="device"``: read a checked step's flags, and report and act on a fault, a step late."""
        late = self._device.take()
        if late is None:
            return
        if late.dead:
            self._name_dead(trainer, pl_module)
        self._device.settle(trainer, pl_module, late, self._replays, self._actions)

    def _name_dead(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Name, once, the parameters and experts whose gradient stopped: a warning, a table, a scalar."""
        if self._dead is not None and self._dead.name_new(pl_module) and self._writer is not None:
            self._actions.write(trainer)
            write_dead(self._writer, self._dead.found, trainer.global_step)

    # what gets logged where

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(trainer, pl_module)  # the epoch's last checked step, with decide="device"
        # A clean run shows flat zeros in TensorBoard rather than no NaN tags at all.
        self._actions.write(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle(trainer, pl_module)


