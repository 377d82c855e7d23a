"""A spike's report, Trainer-free: where it starts, which gradients jumped, and its cause, by replay.

- **Where**: the spiked micro-batch and the last good one, replayed on the same weights with per-module output
  statistics (:func:`~.spike.departures`): the first module whose outputs depart from the good batch's by
  :data:`~.spike.DEPARTS` either way. None departing (a batch of random tokens looks like any other to the
  activations) points at the batch itself.
- **Gradients**: the step's own per-parameter gradient norms against their running norms (kept on the device on good
  steps, read only now): the parameters that jumped most.
- **Cause**: replayed as is, the step is scored again against the same window: calm again is ``transient`` (silent
  data corruption or non-determinism; on one rank only, that rank's device); still spiked but calm with the step in
  fp32, where it runs in a lower precision, is ``precision``; spiked in fp32 too is ``data_or_model``.

Every rank replays its own micro-batch in lockstep, and the rank that spiked highest decides (``agree``), so every
rank builds the same report.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_opkit.core.dtypes import has_low_weights
from lightning_opkit.core.ranks import Ranks, local
from lightning_opkit.core.replay import rng_state, set_rng_state
from lightning_opkit.nan.check import Checked, log_values
from lightning_opkit.nan.replays import MicroBatch, Replays, climb, from_rank, replay_in
from lightning_opkit.nan.report import Cause, NaNReport, Origin
from lightning_opkit.nan.spike import DEPARTS, SpikeWatch, departures

__all__ = ["Found", "SpikeCase", "Spikes", "investigate", "report_spike", "scored_again", "spike_cause",
           "top_jumps", "where_it_starts"]


@dataclass
class SpikeCase:
    """What a spike's slow path works from.

    Args:
        model: the LightningModule.
        modules: ``(path, module)`` pairs to watch.
        step_loss: ``(autocast on?) -> compute_loss`` for the spiked micro-batch.
        rng: the RNG state it started from.
        good: the last good micro-batch's loss function and RNG state, if any.
        batch_idx: the spiked batch's index.
        kind: ``"loss"`` or ``"gradient"``: what spiked.
        threshold: the z-score that makes a spike.
        loss_scale: what the step's check saw of a micro-batch's loss (``1 / accumulate_grad_batches``: Lightning
            hands on the loss divided by it), so a replayed loss is scored on the same footing.
    """

    model: nn.Module
    modules: list[tuple[str, nn.Module]]
    step_loss: Callable[[bool], Callable[[], Tensor | None]]
    rng: Any
    good: tuple[Callable[[], Tensor | None], Any] | None
    batch_idx: int
    kind: str
    threshold: float
    loss_scale: float = 1.0

    @property
    def spiked(self) -> tuple[Callable[[], Tensor | None], Any]:
        """The spiked micro-batch's loss function (as it ran) and RNG state."""
        return self.step_loss(True), self.rng


def where_it_starts(case: SpikeCase, agree: Callable[[Any], Any]) -> tuple[Origin, tuple[str, ...]]:
    """The first departing module (``""``: none departed, the batch itself) and the three that departed most.

    Args:
        case: the spike.
        agree: the spiking rank's value, on every rank.
    """
    if case.good is None:  # no good step since the run began: nothing to compare with
        return agree((Origin(phase=_phase(case), module=None), ()))
    ratios = departures(case.model, case.spiked, case.good, case.modules)
    far = [(path, abs(math.log(max(r, 1e-30)))) for path, r in ratios]
    first = next((path for path, d in far if d > math.log(DEPARTS)), "")
    named = dict(case.model.named_modules())
    module = named.get(first)
    top = tuple(dict.fromkeys(p for p, d in sorted(far, key=lambda pd: -pd[1]) if d > math.log(DEPARTS)))[:3]
    origin = Origin(phase=_phase(case), module=first, module_type=type(module).__name__ if module is not None else "-")
    return agree((origin, top))


def _phase(case: SpikeCase) -> str:
    return "loss" if case.kind == "loss" else "backward"


def top_jumps(norms: Tensor | None, running: Tensor | None, names: list[str], n: int = 3) -> tuple[str, ...]:
    """The ``n`` parameters whose gradient norms jumped most against their running norms (a slow-path sync).

    Args:
        norms: this step's per-parameter gradient norms.
        running: their running norms over good steps (same order), if kept.
        names: the parameters' names, in that order.
        n: how many.

    Example:
        >>> top_jumps(torch.tensor([1.0, 50.0, 2.0]), torch.tensor([1.0, 1.0, 1.0]), ["a", "b", "c"], n=2)
        ('b (50.0x)', 'c (2.0x)')
    """
    if norms is None or running is None or norms.shape != running.shape:
        return ()
    ratio = (norms / running.clamp_min(1e-30)).nan_to_num(posinf=1e30)
    order = ratio.argsort(descending=True)[:n].tolist()
    values = ratio.tolist()
    return tuple(f"{names[i]} ({values[i]:.1f}x)" for i in order if i < len(names))


def scored_again(case: SpikeCase, watch: SpikeWatch, policies: list[Any], culprit: nn.Module | None,
                 fp32: bool) -> float:
    """Replay the spiked micro-batch on the current weights and score what spiked against the same window.

    Args:
        case: the spike.
        watch: the window of good steps.
        policies: attached precision policies (their ``running_in`` runs a module, or the step, in fp32).
        culprit: the module to run in fp32 (``None``: the whole step).
        fp32: run it in fp32 (else as the step ran).
    """
    loss, grads = replay_in(case.step_loss, case.model, case.rng, culprit, policies, fp32=fp32,
                            backward=case.kind == "gradient")
    if loss is None:
        return 0.0
    norms = [g.float().norm() for g in grads if g is not None]
    norm = torch.stack(norms).square().sum().sqrt() if norms else torch.zeros(())
    values = torch.stack([loss.float().mean() * case.loss_scale, norm]).tolist()
    return watch.scores(log_values(values[0], values[1]))[0 if case.kind == "loss" else 1]


def spike_cause(case: SpikeCase, again_in: Callable[[bool], float], lowered: bool, compiled: bool,
                agree: Callable[[Any], Any], where: str) -> Cause:
    """The cause, from replays scored against the same window.

    Args:
        case: the spike.
        again_in: replays the spiked micro-batch (in fp32 if asked) and scores it; every rank calls it alike.
        lowered: the step runs in a lower precision somewhere (autocast, 16-bit weights, a policy's 16-bit classes).
        compiled: the step ran compiled (replays run eagerly).
        agree: the spiking rank's value, on every rank.
        where: the first departing module in words, for the advice.
    """
    scores: dict[bool, float] = {}

    def reproduced(fp32: bool) -> bool:
        scores[fp32] = agree(again_in(fp32))
        return scores[fp32] > case.threshold

    cause = climb(reproduced, lowered)
    if cause == "transient":
        eager = " an eager" if compiled else " a"
        return Cause("transient", f"not reproduced by{eager} replay of the same batch on the same weights (scored"
                                  f" {scores[False]:.1f} against {case.threshold:g}): silent data corruption (a flipped"
                                  " bit in one activation) or non-determinism; if it keeps to one rank, suspect that"
                                  " device")
    if cause == "precision":
        return Cause("precision", f"reproduced as is, calm with the step in fp32: a 16-bit overflow or loss of"
                                  f" precision ({where}); run it in fp32 (PrecisionPolicy(overrides=...)) or train in"
                                  " bf16 or fp32")
    return Cause("data_or_model", f"reproduced by a replay{' in fp32 too' if lowered else ''} ({where}): inspect batch"
                                  f" {case.batch_idx}'s data; a rare or corrupted batch, or a learning rate the model"
                                  " does not take")


@dataclass(frozen=True)
class Found:
    """A spike's findings, the same on every rank: where it starts, what departed and jumped most, its cause."""

    origin: Origin
    top_modules: tuple[str, ...]
    top_parameters: tuple[str, ...]
    cause: Cause


def investigate(case: SpikeCase, watch: SpikeWatch, jumps: Callable[[], tuple[str, ...]], policies: list[Any],
                lowered: bool, compiled: bool, agree: Callable[[Any], Any]) -> Found:
    """Where a spike starts, which gradients jumped, and its cause: the slow path, every rank in lockstep.

    Args:
        case: the spike.
        watch: the window of good steps the replays are scored against.
        jumps: this rank's parameters whose gradient norms jumped most (:func:`top_jumps`).
        policies: attached precision policies.
        lowered: the step runs in a lower precision somewhere.
        compiled: the step ran compiled.
        agree: the spiking rank's value, on every rank.
    """
    origin, top = where_it_starts(case, agree)
    culprit = dict(case.model.named_modules()).get(origin.module) if origin.module else None
    where = f"the first departing module: {origin.module!r}" if culprit is not None else (
        "no module departed from the last good batch: the batch itself differs" if origin.module == ""
        else "no good batch to compare with yet")
    cause = spike_cause(case, lambda fp32: scored_again(case, watch, policies, culprit, fp32), lowered, compiled,
                        agree, where)
    if cause.cause == "transient":  # a calm replay shows nothing of where the step's own spike started
        origin, top = dataclasses.replace(origin, module=None, module_type="-"), ()
    return Found(origin, top, agree(jumps()), cause)


class Spikes:
    """NaNDetector's spike state: the window of good steps, the running gradient norms, the last good micro-batch.

    Args:
        zscore: the score that makes a spike.
        window: good steps the statistics keep.

    Example:
        >>> spikes = Spikes(6.0, 100)
        >>> spikes.start()
        >>> spikes.which_spiked(loss_z=8.0, grad_z=1.0), spikes.which_spiked(loss_z=1.0, grad_z=2.0)
        ('loss', None)
    """

    def __init__(self, zscore: float, window: int) -> None:
        self.zscore, self.window = zscore, window
        self.watch: SpikeWatch | None = None
        #: per-parameter gradient norms, exponentially averaged over good steps (on the device)
        self.running: Tensor | None = None
        #: the last good step's last micro-batch (references: its batch, index and RNG state)
        self.last_good: Any = None
        self._state: dict[str, Any] | None = None
        #: steps judged (past the warm-up), and the highest loss and gradient-norm scores a good step had: how far
        #: below the threshold a healthy run stays
        self.judged = 0
        self.highest = (0.0, 0.0)

    def start(self) -> None:
        """At a fit's setup: the window (a loaded checkpoint's, if any)."""
        self.watch = SpikeWatch(self.window)
        if self._state is not None:
            self.watch.load_state_dict(self._state)

    def judge(self, checked: Checked) -> tuple[str | None, tuple[float, float]]:
        """A finite checked step's scores against the window, and what spiked (``None``: nothing)."""
        scores = self.watch.scores(checked.values) if self.watch is not None else (0.0, 0.0)
        return self.which_spiked(*scores), scores

    def which_spiked(self, loss_z: float, grad_z: float) -> str | None:
        """``"loss"``, ``"gradient"`` or ``None``: what spiked (the loss first: it is what the user watches)."""
        if loss_z > self.zscore:
            return "loss"
        return "gradient" if grad_z > self.zscore else None

    def healthy(self, values: tuple[float, float], norms: Tensor | None, last: Any,
                scores: tuple[float, float]) -> None:
        """A good step: its values enter the window, its gradient norms the running ones (no sync).

        Args:
            values: its log-loss and log-gradient-norm (on the host, from the check's one sync).
            norms: its per-parameter gradient norms (on the device).
            last: its last micro-batch.
            scores: its loss and gradient-norm scores (on the host already, from the check's one sync).
        """
        if self.watch is not None and self.watch.ready:
            self.judged += 1
            self.highest = (max(self.highest[0], scores[0]), max(self.highest[1], scores[1]))
        if self.watch is not None:
            self.watch.record(values)
        if norms is not None:
            if self.running is None or self.running.shape != norms.shape:
                self.running = norms.detach().clone()
            else:
                self.running.mul_(0.9).add_(norms, alpha=0.1)
        self.last_good = last

    def summary_line(self, reports: list[Any]) -> str:
        """The run summary's line: how many spikes, and the first few (step, batch, score, cause)."""
        spikes = [r for r in reports if r.kind == "spike"]
        return (f"  spikes (z > {self.zscore:g} over the last {self.window} good steps): {len(spikes)} in"
                f" {self.judged + len(spikes)} judged steps; highest z of a good step: loss {self.highest[0]:.1f},"
                f" gradient norm {self.highest[1]:.1f}" + "".join(
                    f"; step {r.step} batch {r.batch_idx}: z {r.zscore:.1f}, {r.cause.cause if r.cause else '-'}"
                    for r in spikes[:5]))

    def state_dict(self) -> dict[str, Any]:
        """The window and the judged steps' figures (a resumed run goes on judging against them)."""
        state = self.watch.state_dict() if self.watch is not None else dict(self._state or {})
        return {**state, "judged": self.judged, "highest": list(self.highest)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Back from :meth:`state_dict` (the window applied at once, or at the next :meth:`start`)."""
        self._state = dict(state)
        self.judged = int(state.get("judged", 0))
        highest = state.get("highest") or (0.0, 0.0)
        self.highest = (float(highest[0]), float(highest[1]))
        if self.watch is not None:
            self.watch.load_state_dict(self._state)


def report_spike(replays: Replays, trainer: pl.Trainer, pl_module: pl.LightningModule, spikes: Spikes,
                 pending: list[MicroBatch], checked: Checked, kind: str,
                 optimizer: torch.optim.Optimizer) -> NaNReport:
    """A spike's report: where it starts, what jumped, and why (see :func:`investigate`).

    Args:
        replays: the detector's replays (its watched modules, the step's loss as replayed, the kit it found).
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
    step_loss = replays.step_loss
    case = SpikeCase(pl_module, replays.hooked, functools.partial(step_loss, trainer, pl_module, micro),
                     micro.rng, None if good is None else (step_loss(trainer, pl_module, good), good.rng),
                     micro.batch_idx, kind, spikes.zscore, 1 / n)
    names = {id(p): name for name, p in pl_module.named_parameters()}
    stepped = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"]
               if p.grad is not None and not local(p.grad).is_sparse and local(p.grad).numel()]
    lowered = "mixed" in str(trainer.precision) or has_low_weights(pl_module) or bool(replays.policies)
    try:
        found = investigate(case, spikes.watch, lambda: top_jumps(checked.norms, spikes.running, stepped),
                            replays.policies, lowered, replays.ran_compiled, agree)
    finally:
        set_rng_state(resume_rng)
    # the loss as training_step returned it: Lightning hands on_before_backward it divided by the accumulation
    loss = agree(None if micro.loss is None else micro.loss.float().mean().item() * n)
    report = NaNReport(trainer.global_step, trainer.current_epoch, micro.batch_idx, rank, found.origin, found.cause)
    return dataclasses.replace(report, kind="spike", loss=loss, zscore=spikes.watch.scores(checked.values)[
        0 if kind == "loss" else 1], top_modules=found.top_modules, top_parameters=found.top_parameters)
