"""Run a model's step on one batch under a class table (or plain autocast) and compare runs: loss change, cosine."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.replay import REPLAYING, preserved, quiet_logging, run_step
from lightning_opkit.precision.census import Census
from lightning_opkit.precision.dtypes import GOVERNED, NEVER_CAST
from lightning_opkit.precision.function_mode import ModeState, PolicyMode, hold_rnn_input_casts
from lightning_opkit.precision.oplog import OpLog

__all__ = ["FP32_TABLE", "StepRunner", "grad_cosine", "loss_change", "record_ops", "step_error"]


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (the CPU for a model without any)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


FP32_TABLE: dict[str, str] = dict.fromkeys(GOVERNED, "fp32") | dict.fromkeys(NEVER_CAST, "keep")


class StepRunner:
    """Runs a model's loss and gradients on one batch under a class table (or under autocast), leaving no trace.

    Use it inside :meth:`session`, which keeps the model's buffers, metric states and RNG as they were, runs eagerly
    (compiled code is not re-traced for each table) and silences ``LightningModule.log``.

    Args:
        model: the model, on its device.
        batch: the batch, on that device.
        loss_fn: ``(model, batch) -> scalar loss``.
        loss_scale: differentiate the loss scaled by this and unscale the gradients, as the run's GradScaler does
            (fp16 candidates are judged by the gradients training would get, not by unscaled ones that underflow).
    """

    def __init__(self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Tensor],
                 loss_scale: float | None = None) -> None:
        self.model, self.batch, self.loss_fn, self.loss_scale = model, batch, loss_fn, loss_scale
        self.state = ModeState(FP32_TABLE)
        self.mode = PolicyMode(self.state)
        self._reset: Callable[[], None] | None = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Inside, :meth:`run` may be called any number of times; on exit the model is as it was."""
        model = self.model
        hooks = Patches()
        hold_rnn_input_casts(hooks, model)
        quiet = quiet_logging(model) if isinstance(model, pl.LightningModule) else contextlib.nullcontext()
        with contextlib.ExitStack() as cleanup, preserved(model) as reset, torch.compiler.set_stance("force_eager"), \
                quiet, autocast_off(), REPLAYING.scope():
            cleanup.callback(hooks.restore)
            self._reset = reset
            try:
                yield
            finally:
                self._reset = None

    def run(self, table: dict[str, str] | None = None, log: TorchFunctionMode | None = None,
            census: Census | None = None, autocast: torch.dtype | None = None) -> tuple[Tensor, list[Tensor | None]]:
        """The fp32 loss and the gradients of one run; buffers and RNG put back after.

        It runs under ``table`` (``None``: every class fp32), or, with ``autocast``, under plain ``torch.autocast`` in
        that dtype and no policy.

        Args:
            table: op class -> dtype name.
            log: a mode that records the ops (innermost: it sees what the model called, before any cast).
            census: records what ran in which dtype and its error against fp32 recomputes.
            autocast: run under autocast in this dtype instead of a table (what ``bf16-mixed`` does).
        """
        assert self._reset is not None, "StepRunner.run outside session()"
        self._reset()  # the same RNG, buffers and metric states as every other run: only the dtypes differ
        self.state.set_table(FP32_TABLE if table is None else FP32_TABLE | table)
        self.state.census = census

        def loss() -> Tensor:
            if autocast is not None:
                with torch.autocast(device_of(self.model).type, dtype=autocast):
                    return self.loss_fn(self.model, self.batch)
            with self.mode, log or contextlib.nullcontext():
                return self.loss_fn(self.model, self.batch)

        try:
            # a frozen model: no gradients, the loss alone says it
            value, grads = run_step(self.model, loss, loss_scale=self.loss_scale)
        finally:
            self.state.census = None
            self.state.set_table(FP32_TABLE)
            self._reset()
        assert value is not None
        return value.float(), grads


def record_ops(runner: StepRunner) -> tuple[OpLog, Tensor, list[Tensor | None]]:
    """Run the step once in fp32, recording each governed op's shapes and calls; returns the log and the fp32 run."""
    log = OpLog()
    loss, grads = runner.run(log=log)
    return log, loss, grads


def loss_change(loss: Tensor, ref: Tensor) -> float:
    """``|loss - ref| / |ref|`` (``inf`` if either is not finite)."""
    a, b = float(loss), float(ref)
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def grad_cosine(grads: list[Tensor | None], ref: list[Tensor | None]) -> float | None:
    """Cosine similarity of all gradients to ``ref`` as one vector (``None`` without gradients, -1 if not finite)."""
    pairs = [(g.float(), r.float()) for g, r in zip(grads, ref) if g is not None and r is not None]
    if not pairs:
        return None
    dot = sum((g * r).sum() for g, r in pairs)
    norm_g = sum(g.square().sum() for g, _ in pairs)
    norm_r = sum(r.square().sum() for _, r in pairs)
    value = float(dot / (norm_g.sqrt() * norm_r.sqrt()).clamp_min(1e-30))  # type: ignore[union-attr]
    return value if math.isfinite(value) else -1.0


def step_error(loss_change: float | None, grad_cosine: float | None) -> float:
    """How far a step is from fp32's as one number: the larger of the loss change and ``1 - grad cosine``.

    The figure every whole-step comparison (a candidate table, a module in float8) holds against the tolerance;
    ``inf`` where the step was not measured.

    Example:
        >>> step_error(2e-4, 0.9999), step_error(None, None)
        (0.0002, inf)
    """
    if loss_change is None:
        return math.inf
    return max(loss_change, 0.0 if grad_cosine is None else 1.0 - grad_cosine)
