"""ActivationCheckpointing: checkpoint blocks in place, full or selective by operator class, with its price measured.

Logged (rank zero): ``opkit/checkpointing/{saved_mb_without,saved_mb_with,saved_cut,step_ms_without,step_ms_with,
time_ratio}`` once measured, and ``opkit/checkpointing/report`` (text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_opkit.checkpointing.region import CheckpointedForward
from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.checks import check_bools, check_choices, check_globs, check_int
from lightning_opkit.core.deprecations import renamed
from lightning_opkit.core.facts import facts_of
from lightning_opkit.core.kit import CompilesRegions, loaded_besides, measuring_besides, offering
from lightning_opkit.core.saved import SavedBytes
from lightning_opkit.core.select import find_blocks, outermost, resolve_modules
from lightning_opkit.core.torch_compat import COMPILES_UNDER_SELECTIVE_CHECKPOINT
from lightning_opkit.core.trial import WARMUP, Trial
from lightning_opkit.core.warn import warn_once
from lightning_opkit.opclass import OP_CLASSES

__all__ = ["ActivationCheckpointing", "Price"]

#: steps before the measurement: the first steps compile (TorchCompile), measure peaks, choose dtypes
_WARMUP = 3
#: then one step each way counts the bytes autograd saves, untimed: the count's pack hook costs time per saved tensor,
#: far more without checkpointing (on the example ViT it made checkpointing look 13% *faster*)
_COUNTED = ("with", "without")


@dataclass
class Price:
    """What checkpointing saves and costs, measured on steps with and without it.

    The bytes come from one step each way, the times are the medians of the timed steps.

    Args:
        saved_without: activation bytes autograd saves for backward in a step without checkpointing.
        saved_with: the same with it.
        step_s_without: a step's time without it.
        step_s_with: with it (the recompute in backward included).
    """

    saved_without: int
    saved_with: int
    step_s_without: float
    step_s_with: float

    @property
    def cut(self) -> float:
        """The fraction of the saved activation bytes checkpointing removes."""
        return 1 - self.saved_with / self.saved_without if self.saved_without else 0.0

    @property
    def time_ratio(self) -> float:
        """A step's time with checkpointing over without."""
        return self.step_s_with / self.step_s_without if self.step_s_without else float("nan")


class ActivationCheckpointing(OpkitCallback):
    """Recompute blocks' activations in backward instead of keeping them: in place, full or selective, priced.

    Each selected block's ``forward`` is replaced by one that runs it under ``torch.utils.checkpoint`` (non-reentrant):
    no wrapper modules, ``state_dict`` keys unchanged, undone at teardown. With ``save``, it is selective: outputs of
    ops of those operator classes are kept (``["matmul", "attention"]`` keeps the GEMMs' and attention's, as
    torchtitan does) and only the rest is recomputed. The recompute runs in the forward's dtypes (autocast and an
    attached PrecisionPolicy's), with the same RNG state, so losses and gradients are those of the run without it.

    With ``measure=True``, a few steps early in the fit (from the fourth) run with and without checkpointing (every
    rank alike): one step each way counts the activation bytes autograd saves, then timed steps take turns
    (:class:`~lightning_opkit.core.trial.Trial`), counting nothing (the count costs time per saved tensor), and the
    bytes and the step times are compared: that is the price. It begins once no other callback times alternatives on
    the steps (the policy's contender tables, TorchCompile's eager against compiled): two such trials at once would
    time each other. Off by default: the steps without checkpointing need the memory it frees, and a run that needs
    checkpointing to fit would run out of memory in them; ask for the price where they fit.

    Args:
        modules: ``None`` (or ``"auto"``): the model's repeated blocks (children of a ``ModuleList``/``Sequential``
            sharing a class); else globs over ``named_modules()`` names (the outermost matches are checkpointed).
        save: operator classes whose outputs are kept (selective checkpointing); ``None``: keep only the blocks'
            inputs.
        measure: measure the bytes saved and the time it costs, once, on ``trial_steps`` steps *without*
            checkpointing beside as many with it (they need the memory it frees: off by default).
        trial_steps: timed steps with and as many without checkpointing, taking turns, after three warm-up steps
            (the first steps compile, and measure what other callbacks measure) and the two that count the bytes;
            the kit's name for the steps each alternative of a timed trial runs (PrecisionPolicy's too).
        enabled: attach the callback; ``False`` (or its area, ``checkpointing``, in the environment variable
            ``OPKIT_DISABLE``) leaves it attaching nothing, said once at setup.
        log_dir: where to write opkit's TensorBoard files when the Trainer has no TensorBoard logger (by default none
            then: ``logger=False`` writes no file).
        measure_steps: the old name of ``trial_steps``: it works for this release and warns
            (:class:`~lightning_opkit.core.deprecations.OpkitDeprecationWarning`).

    Example:
        >>> trainer = pl.Trainer(callbacks=[ActivationCheckpointing(save=["matmul", "attention"])], logger=False)
        >>> [type(c).__name__ for c in trainer.callbacks if isinstance(c, ActivationCheckpointing)]
        ['ActivationCheckpointing']
    """

    area = "checkpointing"

    def __init__(
        self,
        modules: Union[list[str], Literal["auto"], None] = None,
        save: Optional[list[str]] = None,
        measure: bool = False,
        trial_steps: int = 3,
        enabled: bool = True,
        log_dir: Optional[str] = None,
        measure_steps: Optional[int] = None,
    ) -> None:
        super().__init__(enabled, log_dir)
        trial_steps = renamed(type(self).__name__, "measure_steps", measure_steps, "trial_steps", trial_steps, 3)
        check_globs("modules", modules, ("auto",))
        modules = "auto" if modules is None else modules
        check_choices("save", save, OP_CLASSES)
        check_bools(measure=measure)
        check_int("trial_steps", trial_steps, 1)
        self.modules = modules if modules == "auto" else list(modules)
        self.save = list(save) if save is not None else None
        self.measure = measure
        self.trial_steps = trial_steps
        #: checkpointed block paths
        self.checkpointed: list[str] = []
        #: the measured price, once measured
        self.price: Price | None = None
        #: blocks whose checkpoint runs outside the compiled graph (TorchCompile's "eager" backend, blocks with buffers)
        self.untraced: list[str] = []
        self._regions: list[CheckpointedForward] = []
        self._found: list[tuple[str, torch.nn.Module]] = []
        self._trial: Trial | None = None
        self._saved: SavedBytes | None = None
        self._counting: Any = None
        self._saved_bytes: dict[str, int] = {}
        #: the step in flight's arm and whether it is timed (else it counts the bytes saved)
        self._step: tuple[str, bool] | None = None
        #: steps the measurement waited, ready to begin, for another callback's timed trial
        self._waited = 0

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """Saved activation bytes and step time, without and with checkpointing."""
        return {"opkit checkpointing": {
            "saved activations (MB)": ["Multiline", [r"opkit/checkpointing/saved_mb_without",
                                                     r"opkit/checkpointing/saved_mb_with"]],
            "step time (ms)": ["Multiline", [r"opkit/checkpointing/step_ms_without",
                                             r"opkit/checkpointing/step_ms_with"]],
        }}

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        what = f"selective, keeping {', '.join(self.save)}" if self.save else "full"
        line = f"activation checkpointing ({what}): {len(self.checkpointed)} block(s)"
        if self.price is not None:
            p = self.price
            change = f"{p.cut:.0%} less" if p.cut >= 0 else f"{-p.cut:.0%} more: it keeps more than it frees here"
            line += (f"; saved activations {p.saved_without / 2**20:.1f} -> {p.saved_with / 2**20:.1f} MB"
                     f" ({change}), step time x{p.time_ratio:.2f}")
        elif not self.measure:
            line += "; price not measured (measure=True runs a few steps without checkpointing to measure it)"
        elif self._waited:
            line += (f"; price not measured yet: it waited {self._waited} step(s) for another callback timing its"
                     " alternatives on the training steps (one timed trial at a time)")
        if self.untraced:
            line += (f"; {len(self.untraced)} block(s) with buffers checkpointed outside the compiled graph (torch's"
                     " 'eager' backend fails on a traced checkpoint that updates buffers)")
        return [line]

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._patches:
            return
        self._found = self._targets(pl_module)  # a bad glob fails here, before anything runs
        self._open_writer(trainer, stage)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After every callback's setup: a block TorchCompile compiled is checkpointed from outside (the compiled
        # forward recomputed in backward), whichever of the two comes first in the callbacks.
        if self._patches:
            return
        targets, self._found = self._found, []
        self._regions = []
        compilers = list(offering(trainer, CompilesRegions))
        eager_backend = any(c.backend == "eager" for c in compilers)
        if self.save and compilers and not COMPILES_UNDER_SELECTIVE_CHECKPOINT:
            warn_once(f"ActivationCheckpointing(save={self.save}) beside TorchCompile: on torch {torch.__version__}"
                      " dynamo compiles nothing inside a selective checkpoint, so the checkpointed blocks run eagerly"
                      " there. Use save=None (full checkpointing), or torch 2.11 or later.")
        self.untraced = []
        for name, module in targets:
            region = CheckpointedForward(module, module.forward, tuple(self.save or ()))
            if eager_backend and region.buffers:
                # torch's "eager" backend runs a traced checkpoint whose forward updates buffers (BatchNorm's
                # num_batches_tracked) into a version-counter error in backward; eagerly, the checkpoint is right
                region.traced = False
                self.untraced.append(name)
            self._patches.set(module, "forward", region)
            self._regions.append(region)
        self.checkpointed = [name for name, _ in targets]
        facts_of(trainer).checkpointed.update({name: list(self.save or []) for name in self.checkpointed})
        self._saved = SavedBytes(pl_module)
        assert self._writer is not None
        self._writer.table("opkit/checkpointing/config", ["setting", "value"],
                     [["checkpointed", ", ".join(self.checkpointed)], ["save", ", ".join(self.save or []) or "-"]],
                     trainer.global_step)

    def _targets(self, pl_module: pl.LightningModule) -> list[tuple[str, torch.nn.Module]]:
        if self.modules == "auto":
            names = find_blocks(pl_module)
            if not names:
                raise ValueError(
                    f"ActivationCheckpointing(modules='auto') found no repeated blocks in {type(pl_module).__name__}"
                    " (children of a ModuleList/Sequential that share one class): name the modules as globs.")
            rank_zero_info(f"ActivationCheckpointing(modules='auto') checkpoints {len(names)} blocks")
            return [(name, pl_module.get_submodule(name)) for name in names]
        return outermost(resolve_modules(pl_module, self.modules, owner="ActivationCheckpointing"))

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        self._stop_counting()
        self._regions, self._found = [], []
        self._trial, self._step, self._waited = None, None, 0  # a measurement left unfinished starts over

    # the measurement: warm-up, one counted step each way, then timed steps with, without, without, with, ...

    @property
    def measuring_steps(self) -> bool:
        """Whether its steps with and without checkpointing are under way (the kit runs one timed trial at a time)."""
        return self._trial is not None and self._trial.calls > _WARMUP and self.price is None

    def _phase(self, trainer: pl.Trainer) -> tuple[str, bool] | None:
        """This step's arm, ``"with"`` or ``"without"`` checkpointing, and whether it is timed; ``None``: neither."""
        if not self.measure or self.price is not None:
            return None
        if self._trial is None:
            self._trial = Trial(["with", "without"], rounds=self.trial_steps, warmup=_WARMUP + len(_COUNTED))
            self._saved_bytes = {}
        if self._trial.calls == _WARMUP and measuring_besides(trainer, self):
            self._waited += 1  # its first arm would time the other's alternatives too: not begun yet
            return None
        if self._trial.calls >= _WARMUP and loaded_besides(trainer, self):
            return None  # a census step: every op recomputed in fp32, no fair sample (the step runs checkpointed)
        arm, counted = self._trial.next(), self._trial.calls - 1 - _WARMUP
        if arm != WARMUP:
            return (arm, True) if arm is not None else None
        return (_COUNTED[counted], False) if counted >= 0 else None

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step = step = self._phase(trainer)
        assert self._saved is not None
        for region in self._regions:
            region.enabled = step is None or step[0] != "without"
            region.note_kept = self._saved.note if step == ("with", False) else None
        if step is None:
            return
        assert self._trial is not None
        if step[1]:
            self._trial.start(step[0], pl_module.device)
            return
        self._saved.activations = 0
        self._counting = self._saved.counting()
        self._counting.__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._stop_counting()  # the forward is done: what autograd saved is what the step holds until backward

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # the step ends here, optimizer step included: not at the next batch's start, which after an epoch's last
        # batch comes after the whole validation loop
        self._close_sample(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_sample(trainer, pl_module)

    def _stop_counting(self) -> None:
        if self._counting is not None:
            counting, self._counting = self._counting, None
            counting.__exit__(None, None, None)

    def _close_sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At the batch's end: the measured step's time (batch start to batch end) or bytes."""
        if self._step is None:
            return
        (arm, timed), self._step = self._step, None
        assert self._saved is not None
        assert self._trial is not None
        if timed:
            self._trial.stop()
        else:
            self._stop_counting()
            self._saved_bytes[arm] = self._saved.activations
        if self._trial.done:
            self._priced(trainer, self._trial)

    def _priced(self, trainer: pl.Trainer, trial: Trial) -> None:
        saved = self._saved_bytes
        self.price = Price(saved["without"], saved["with"], trial.median("without"), trial.median("with"))
        p = self.price
        self._scalars("opkit/checkpointing", {
            "saved_mb_without": p.saved_without / 2**20, "saved_mb_with": p.saved_with / 2**20, "saved_cut": p.cut,
            "step_ms_without": 1e3 * p.step_s_without, "step_ms_with": 1e3 * p.step_s_with,
            "time_ratio": p.time_ratio}, trainer.global_step)
        if self._writer is not None:
            self._writer.text("opkit/checkpointing/report", self.summary_lines()[0], trainer.global_step)
            self._writer.flush()
