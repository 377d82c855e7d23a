"""The slow path of a fault: replay the step's micro-batches to find where it starts, then why; the report.

Only a failed check gets here. Every rank replays every micro-batch until one rank reproduces the fault, then runs
the cause replays with that rank's culprit: the same replays on every rank, in lockstep. What decides the report (the
gathered origins, each replay's outcome) is the same on every rank, so every rank builds the same one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_opkit.core.fp32 import has_low_weights
from lightning_opkit.core.kit import CompilesRegions, RunsModulesInDtype, offering
from lightning_opkit.core.ranks import Ranks, local
from lightning_opkit.core.replay import rng_state, set_rng_state
from lightning_opkit.core.step_loss import training_loss
from lightning_opkit.nan.cause import diagnose
from lightning_opkit.nan.check import Checked, bad_gradient_shard, log_values
from lightning_opkit.nan.locate import locate
from lightning_opkit.nan.report import SHARD_ONLY, Cause, NaNReport, Origin, not_reproduced
from lightning_opkit.nan.scaler import collapse_cause
from lightning_opkit.nan.spike_report import SpikeCase, Spikes, investigate, top_jumps

__all__ = ["MicroBatch", "Replays", "from_rank", "ran_compiled"]


@dataclass
class MicroBatch:
    """What a replay needs to run one micro-batch again: the batch, its index, the RNG state before it, its loss."""

    batch: Any
    batch_idx: int
    rng: tuple[Tensor, Any]
    loss: Tensor | None = None


def ran_compiled(trainer: pl.Trainer) -> bool:
    """Whether the step ran (partly) compiled: every replay runs eagerly, so not reproducing a fault says less."""
    return any(c.compiled for c in offering(trainer, CompilesRegions))


def from_rank(ranks: Ranks, rank: int, value: Any) -> Any:
    """``value`` as ``rank`` has it, on every rank."""
    return ranks.from_rank(value, rank)


class Replays:
    """Replays a faulty step to name its origin and cause, and builds the report.

    Args:
        forward: watch modules' outputs.
        backward: watch gradients.
        loss: watch the loss.

    A report's ``action`` is left at its default here: :class:`~lightning_opkit.nan.actions.Actions`, which holds the
    detector's action, writes it in when it keeps the report.

    Example:
        >>> replays = Replays(forward=True, backward=True, loss=True)
        >>> replays.hooked
        []
    """

    def __init__(self, forward: bool, backward: bool, loss: bool) -> None:
        self.forward, self.backward, self.loss = forward, backward, loss
        #: the modules to localize among (named), set at the fit's setup
        self.hooked: list[tuple[str, torch.nn.Module]] = []

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: list[MicroBatch],
               loss_bad: bool, optimizer: torch.optim.Optimizer | None) -> NaNReport:
        """The report of a failed check: origin and cause from replays, else from the gradient shards, else unseen.

        Args:
            trainer: the Trainer.
            pl_module: the LightningModule, on the weights the step ran on.
            pending: the step's micro-batches.
            loss_bad: the check found a loss non-finite.
            optimizer: the step's optimizer, whose gradient shards are the step's; ``None`` when read a step late
                (the gradients are then the next step's).
        """
        ranks = Ranks(pl_module.device)
        resume_rng = rng_state()
        try:
            seen = self.first_seen(trainer, pl_module, pending, ranks)
            if seen is not None:
                micro, origin, culprit = seen
                cause = self.cause(trainer, pl_module, micro, origin, functools.partial(from_rank, ranks, culprit))
                return self.new_report(trainer, micro.batch_idx, origin, cause, culprit)
        finally:
            set_rng_state(resume_rng)
        # Not reproduced by any replay. A sharded gradient (FSDP2, tensor parallel) is not seen by a replay's
        # parameter hooks at all, but the step's own gradient shards say which parameter went bad, and where.
        shard = (bad_gradient_shard(pl_module, optimizer) if self.backward and not loss_bad and optimizer
                 else None)
        found = [(r, o) for r, o in enumerate(ranks.gather(shard)) if o is not None]
        batch_idx = pending[-1].batch_idx if pending else -1
        if found:
            rank, origin = found[0]
            return self.new_report(trainer, batch_idx, origin, SHARD_ONLY, rank)
        unseen = Origin(phase="loss" if loss_bad else "backward", module=None)
        return self.new_report(trainer, batch_idx, unseen, not_reproduced(ran_compiled(trainer)), 0)

    def forward_fault(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: list[MicroBatch]) -> bool:
        """Whether a module's forward output went non-finite on some rank: forward-only replays.

        Under a GradScaler, non-finite gradients beside a finite loss are usually the scaled backward overflowing,
        which the scaler handles; but loss scaling cannot make a forward activation non-finite (one the loss never
        reads, as the last position's logits of a language model), so that is a fault of its own.
        """
        if not self.forward:
            return False
        ranks, resume_rng = Ranks(pl_module.device), rng_state()
        try:
            return self.first_seen(trainer, pl_module, pending, ranks, forward_only=True) is not None
        finally:
            set_rng_state(resume_rng)

    def first_seen(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: list[MicroBatch],
                   ranks: Ranks, scale: float | None = None,
                   forward_only: bool = False) -> tuple[MicroBatch, Origin, int] | None:
        """Replay micro-batches until one rank reproduces the fault: the micro-batch, the origin, that rank.

        With ``scale``, the loss is scaled as the GradScaler scaled the step's, and backward alone is watched; with
        ``forward_only``, the forward alone.
        """
        for micro in pending:
            origins = ranks.gather(locate(
                pl_module, self.step_loss(trainer, pl_module, micro, scale=scale), micro.rng, modules=self.hooked,
                forward=self.forward and scale is None, backward=self.backward and not forward_only,
                loss=self.loss and scale is None and not forward_only, any_rank=ranks.any))
            seen = [(o.seq, r) for r, o in enumerate(origins) if o is not None]
            if seen:
                culprit = min(seen)[1]  # the rank that saw it first in the step, the lowest rank on a tie
                return micro, origins[culprit], culprit
        return None

    def collapse_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, pending: list[MicroBatch],
                        scale: float, collapse: str) -> NaNReport:
        """A GradScaler's collapse: where the gradients first went non-finite at ``scale`` (a backward replay).

        Args:
            trainer: the Trainer.
            pl_module: the LightningModule.
            pending: the step's micro-batches.
            scale: the GradScaler's scale now.
            collapse: the collapse in words (:meth:`~lightning_opkit.nan.scaler.ScaleWatch.describe`).
        """
        ranks, resume_rng = Ranks(pl_module.device), rng_state()
        try:
            seen = self.first_seen(trainer, pl_module, pending, ranks, scale=scale)
        finally:
            set_rng_state(resume_rng)
        origin = seen[1] if seen is not None else Origin(phase="backward", module=None)
        return self.new_report(trainer, pending[-1].batch_idx if pending else -1, origin,
                               collapse_cause(collapse, origin.module), 0)

    def new_report(self, trainer: pl.Trainer, batch_idx: int, origin: Origin, cause: Cause | None,
                   rank: int) -> NaNReport:
        """A report at the Trainer's current step and epoch."""
        return NaNReport(trainer.global_step, trainer.current_epoch, batch_idx, rank, origin, cause)

    def spike_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, spikes: Spikes,
                     pending: list[MicroBatch], checked: Checked, kind: str,
                     optimizer: torch.optim.Optimizer) -> NaNReport:
        """A spike's report: where it starts, what jumped, and why (see :func:`.spike_report.investigate`).

        Args:
            trainer: the Trainer.
            pl_module: the LightningModule, on the weights the step ran on.
            spikes: the detector's spike statistics.
            pending: the step's micro-batches.
            checked: the step's check (its values, norms and this rank's own values).
            kind: ``"loss"`` or ``"gradient"``: what spiked.
            optimizer: the optimizer about to step.
        """
        if checked.local is None or spikes.watch is None:
            raise RuntimeError("NaNDetector: a spike was scored without a spike watch")
        ranks, resume_rng = Ranks(pl_module.device), rng_state()
        own_loss, own_norm = checked.local.tolist()  # the slow path: syncs freely
        own = spikes.watch.scores(log_values(own_loss, own_norm))[0 if kind == "loss" else 1]
        # the rank that spiked highest (the lowest on a tie)
        rank = max(enumerate(ranks.gather(own)), key=lambda rv: rv[1])[0]
        agree = functools.partial(from_rank, ranks, rank)
        micro = max(pending, key=lambda m: -math.inf if m.loss is None else m.loss.float().mean().item())
        good, n = spikes.last_good, max(len(pending), 1)
        step_loss = self.step_loss
        case = SpikeCase(pl_module, self.hooked, functools.partial(step_loss, trainer, pl_module, micro),
                         micro.rng, None if good is None else (step_loss(trainer, pl_module, good), good.rng),
                         micro.batch_idx, kind, spikes.zscore, 1 / n)
        policies: list[RunsModulesInDtype] = list(offering(trainer, RunsModulesInDtype))
        names = {id(p): name for name, p in pl_module.named_parameters()}
        stepped = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]
                   if p.grad is not None and not local(p.grad).is_sparse and local(p.grad).numel()]
        lowered = "mixed" in str(trainer.precision) or has_low_weights(pl_module) or bool(policies)
        try:
            found = investigate(case, spikes.watch, lambda: top_jumps(checked.norms, spikes.running, stepped), policies,
                                lowered, ran_compiled(trainer), agree)
        finally:
            set_rng_state(resume_rng)
        # the loss as training_step returned it: Lightning hands on_before_backward it divided by the accumulation
        loss = agree(None if micro.loss is None else micro.loss.float().mean().item() * n)
        report = NaNReport(trainer.global_step, trainer.current_epoch, micro.batch_idx, rank, found.origin, found.cause)
        return dataclasses.replace(report, kind="spike", loss=loss, zscore=spikes.watch.scores(checked.values)[
            0 if kind == "loss" else 1], top_modules=found.top_modules, top_parameters=found.top_parameters)

    @staticmethod
    def step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, micro: MicroBatch,
                  autocast: bool = True, scale: float | None = None) -> Callable[[], Tensor | None]:
        """The micro-batch's training step as a replay runs it: the precision plugin's autocast, nothing logged.

        Nothing is stepped either, under manual optimization (:func:`~lightning_opkit.core.step_loss.training_loss`).
        """
        def compute_loss() -> Tensor | None:
            plugin = trainer.precision_plugin.train_step_context() if autocast else contextlib.nullcontext()
            with plugin:
                loss = training_loss(pl_module, micro.batch, micro.batch_idx)
            return loss if scale is None or loss is None else loss * scale

        return compute_loss

    def cause(self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: MicroBatch, origin: Origin,
              agree: Callable[[Any], Any]) -> Cause:
        """Replay as is, then with the culprit in fp32: see :func:`~lightning_opkit.nan.cause.diagnose`."""
        policies: list[RunsModulesInDtype] = list(offering(trainer, RunsModulesInDtype))  # a policy runs it in fp32
        return diagnose(lambda autocast: self.step_loss(trainer, pl_module, micro, autocast), pl_module, micro.rng,
                        origin, dict(pl_module.named_modules()), policies, micro.batch_idx, agree,
                        compiled=ran_compiled(trainer))
