"""The slow path of a fault: replay the step's micro-batches to find where it starts, then why; the report.

Only a failed check gets here. Every rank replays every micro-batch until one rank reproduces the fault, then runs
the cause replays with that rank's culprit: the same replays on every rank, in lockstep. What decides the report (the
gathered origins, each replay's outcome) is the same on every rank, so every rank builds the same one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_opkit.core.kit import CompilesRegions, RunsModulesInDtype, offering
from lightning_opkit.core.ranks import Ranks
from lightning_opkit.core.replay import rng_state, set_rng_state
from lightning_opkit.core.step_loss import training_loss
from lightning_opkit.nan.cause import diagnose
from lightning_opkit.nan.check import bad_gradient_shard
from lightning_opkit.nan.locate import locate
from lightning_opkit.nan.report import SHARD_ONLY, Cause, NaNReport, Origin, not_reproduced

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
        action: the detector's action, written into reports.

    Example:
        >>> replays = Replays(forward=True, backward=True, loss=True, action="raise")
        >>> replays.hooked
        []
    """

    def __init__(self, forward: bool, backward: bool, loss: bool, action: str) -> None:
        self.forward, self.backward, self.loss, self.action = forward, backward, loss, action
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

    def new_report(self, trainer: pl.Trainer, batch_idx: int, origin: Origin, cause: Cause | None,
                   rank: int) -> NaNReport:
        """A report at the Trainer's current step and epoch."""
        return NaNReport(trainer.global_step, trainer.current_epoch, batch_idx, rank, origin, cause, self.action)

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
        """Replay with the culprit in fp32, then as is: see :func:`~lightning_opkit.nan.cause.diagnose`."""
        policies: list[RunsModulesInDtype] = list(offering(trainer, RunsModulesInDtype))  # a policy runs it in fp32
        return diagnose(lambda autocast: self.step_loss(trainer, pl_module, micro, autocast), pl_module, micro.rng,
                        origin, dict(pl_module.named_modules()), policies, micro.batch_idx, agree,
                        compiled=ran_compiled(trainer))
