"""The slow path of a fault: replay the step's micro-batches to find where it starts, then why; the report.

Only a failed check gets here, so everything here may sync freely. In one file, in the order a fault takes them:

- :class:`Replays`: every rank replays every micro-batch until one rank reproduces the fault, then runs the cause
  replays with that rank's culprit: the same replays on every rank, in lockstep. What decides the report (the
  gathered origins, each replay's outcome) is the same on every rank, so every rank builds the same one.
- **Where** (:func:`locate`): one replay with per-module hooks names where the first non-finite value appeared.
- **Why** (:func:`diagnose`, :func:`climb`): one ladder for NaN faults and loss spikes alike, always in this order:
  the step replayed **as is** (not reproduced: ``transient``), then, where the step runs in a lower precision
  somewhere, with the culprit **in fp32** (gone: ``precision``), else ``data_or_model``. A NaN fault counts every
  step as lowered (the fp32 replay is what tells the reader "in fp32 too"); a spike only a step that runs in 16-bit
  somewhere (:mod:`~lightning_opkit.nan.spike_report` climbs the same ladder). ``precision``: finite with the
  culprit in fp32, non-finite as is (a 16-bit overflow or underflow); ``data_or_model``: non-finite in fp32 too (the
  batch, a log of zero, a learning rate that diverged); ``transient``: not reproduced by a second replay as is
  (non-deterministic code or hardware); ``unknown``: a replay failed, so the cause could not be observed.

:func:`locate` and :func:`diagnose` work on a plain ``nn.Module`` and a callable that computes the loss, and are
tested without a Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.dtypes import full_name, has_low_weights, in_fp32
from lightning_opkit.core.fsdp import reshard
from lightning_opkit.core.kit import CompilesRegions, RunsModulesInDtype, offering
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.ranks import Ranks, local, local_floats
from lightning_opkit.core.replay import (
    REPLAYING,
    preserved,
    replay_backward,
    rng_state,
    run_step,
    set_rng_state,
    training_loss,
)
from lightning_opkit.core.text import describe_error
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.check import bad_gradient_shard
from lightning_opkit.nan.report import SHARD_ONLY, Cause, NaNReport, Origin, not_reproduced
from lightning_opkit.nan.scaler import collapse_cause
from lightning_opkit.opclass import classify_function, classify_module

__all__ = ["MicroBatch", "ReplayFailed", "Replays", "Stats", "climb", "diagnose", "from_rank", "locate", "replay_in"]


@dataclass
class MicroBatch:
    """What a replay needs to run one micro-batch again: the batch, its index, the RNG state before it, its loss."""

    batch: Any
    batch_idx: int
    rng: tuple[Tensor, Any]
    loss: Tensor | None = None


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
        #: the kit's members a cause replay asks (a policy runs the culprit in fp32; a compiler says the step ran
        #: compiled), found once by :meth:`join`: a fault's path consults no registry
        self.policies: list[RunsModulesInDtype] = []
        self.compilers: list[CompilesRegions] = []

    def join(self, trainer: pl.Trainer) -> None:
        """Find the Trainer's callbacks the replays ask, at the fit's setup (its callbacks are final by then)."""
        self.policies = list(offering(trainer, RunsModulesInDtype))
        self.compilers = list(offering(trainer, CompilesRegions))

    @property
    def ran_compiled(self) -> bool:
        """Whether the step ran (partly) compiled: every replay runs eagerly, so not reproducing a fault says less."""
        return any(c.compiled for c in self.compilers)

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
        return self.new_report(trainer, batch_idx, unseen, not_reproduced(self.ran_compiled), 0)

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

    @staticmethod
    def step_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, micro: MicroBatch,
                  autocast: bool = True, scale: float | None = None) -> Callable[[], Tensor | None]:
        """The micro-batch's training step as a replay runs it: the precision plugin's autocast, nothing logged.

        Nothing is stepped either, under manual optimization (:func:`~lightning_opkit.core.replay.training_loss`).
        """
        def compute_loss() -> Tensor | None:
            plugin = trainer.precision_plugin.train_step_context() if autocast else contextlib.nullcontext()
            with plugin:
                loss = training_loss(pl_module, micro.batch, micro.batch_idx)
            return loss if scale is None or loss is None else loss * scale

        return compute_loss

    def cause(self, trainer: pl.Trainer, pl_module: pl.LightningModule, micro: MicroBatch, origin: Origin,
              agree: Callable[[Any], Any]) -> Cause:
        """Replay as is, then with the culprit in fp32: see :func:`~lightning_opkit.nan.replays.diagnose`."""
        return diagnose(lambda autocast: self.step_loss(trainer, pl_module, micro, autocast), pl_module, micro.rng,
                        origin, dict(pl_module.named_modules()), self.policies, micro.batch_idx, agree,
                        compiled=self.ran_compiled)


# Where: the first non-finite value, found by one replay with per-module hooks.


@dataclass(frozen=True)
class Stats:
    """Finiteness of some tensors, read by name: whether any value is bad, NaN and Inf counts, the finite range."""

    bad: bool
    nan: int
    inf: int
    min: float
    max: float
    absmax: float


_NO_TENSORS = Stats(False, 0, 0, float("nan"), float("nan"), float("nan"))


def _stats(tensors: list[Tensor], masks_ok: bool = False) -> Stats:
    """The :class:`Stats` of ``tensors`` (a replay's hook: it may sync).

    ``bad`` is any non-finite value; with ``masks_ok`` only NaN and ``+inf`` count, because ``-inf`` is how attention
    masks say "never" (``nn.Transformer.generate_square_subsequent_mask``) and is finite in effect after a softmax.
    """
    if not tensors:
        return _NO_TENSORS
    rows = []
    for t in tensors:
        t = t.detach().float()
        finite = t.isfinite()
        nan = t.isnan()
        bad = (nan | (t == torch.inf)) if masks_ok else ~finite
        rows.append(torch.stack([
            bad.any().float(), nan.sum().float(), t.isinf().sum().float(),
            torch.where(finite, t, torch.inf).amin(), torch.where(finite, t, -torch.inf).amax(),
            torch.where(finite, t.abs(), -torch.inf).amax(),
        ]))
    s = torch.stack(rows).cpu()
    return Stats(bool(s[:, 0].amax() > 0), int(s[:, 1].sum()), int(s[:, 2].sum()), float(s[:, 3].amin()),
                 float(s[:, 4].amax()), float(s[:, 5].amax()))


class _OpsByModule(TorchFunctionMode):
    """Counts the op classes each module runs itself (its innermost place on the module stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[nn.Module] = []
        self.ops: dict[int, Counter[str]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.stack:
            self.ops.setdefault(id(self.stack[-1]), Counter())[classify_function(func)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class _Record:
    kind: str  # "module" or "param"
    name: str
    module: nn.Module | None
    dtype: str
    inputs: Stats  # of inputs (forward) / grad_output (backward)
    outputs: Stats  # of output (forward) / grad_input or parameter grad (backward)


@dataclass
class Recorder:
    """Hooks that record, per module and in execution order, whether inputs and outputs were finite.

    Args:
        modules: ``(path, module)`` pairs to hook.
        params: ``(name, parameter)`` pairs whose gradients to record.
        forward: record forward outputs.
        backward: record module input-gradients and parameter gradients.
        module_backward: with ``backward``, hook modules' backward too (parameters only when ``False``).

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> with Recorder([("0", layer)], [], forward=True, backward=False) as rec:
        ...     _ = layer(torch.tensor([[float("nan"), 1.0]]))
        >>> rec.forward_origin() is None  # its input was already non-finite: not the origin
        True
    """

    modules: list[tuple[str, nn.Module]]
    params: list[tuple[str, nn.Parameter]]
    forward: bool = True
    backward: bool = True
    module_backward: bool = True
    fwd: list[_Record] = field(default_factory=list)
    bwd: list[_Record] = field(default_factory=list)
    ops: _OpsByModule = field(default_factory=_OpsByModule)
    _patches: Patches = field(default_factory=Patches)

    def __enter__(self) -> Recorder:
        for path, module in self.modules:
            self._patches.hold(module.register_forward_pre_hook(self._enter_module))
            self._patches.hold(module.register_forward_hook(self._leave_module, always_call=True))
            if self.forward:
                self._patches.hold(module.register_forward_hook(self._forward_hook(path), with_kwargs=True))
            if self.backward and self.module_backward:
                self._patches.hold(module.register_full_backward_hook(self._backward_hook(path)))
        if self.backward:
            for name, param in self.params:
                if param.requires_grad:
                    self._patches.hold(param.register_hook(self._param_hook(name, param)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._patches.restore()

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self.ops.stack.append(module)

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.ops.stack and self.ops.stack[-1] is module:
            self.ops.stack.pop()

    def op_class(self, module: nn.Module | None) -> str:
        """The op class of ``module``: its ``torch.nn`` type, else what it ran itself during the replay."""
        if module is None:
            return "other"
        return classify_module(module, self.ops.ops.get(id(module)))

    def _forward_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            outs = local_floats(output)
            dtype = full_name(outs[0].dtype) if outs else "-"
            self.fwd.append(_Record("module", path, module, dtype, _stats(local_floats((args, kwargs)), masks_ok=True),
                                    _stats(outs, masks_ok=True)))

        return hook

    def _backward_hook(self, path: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            gin = local_floats(grad_input)
            dtype = full_name(gin[0].dtype) if gin else "-"
            self.bwd.append(_Record("module", path, module, dtype, _stats(local_floats(grad_output)), _stats(gin)))

        return hook

    def _param_hook(self, name: str, param: nn.Parameter) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            dtype = full_name(grad.dtype)
            self.bwd.append(_Record("param", name, None, dtype, _stats([]), _stats([local(grad)])))

        return hook

    def forward_origin(self) -> _Record | None:
        """The first module whose output is non-finite while its inputs were finite."""
        return next((r for r in self.fwd if r.outputs.bad and not r.inputs.bad), None)

    def backward_origin(self) -> _Record | None:
        """The first module whose input-gradient went non-finite from a finite output-gradient, else a parameter."""
        origin = next((r for r in self.bwd if r.kind == "module" and r.outputs.bad and not r.inputs.bad), None)
        return origin or next((r for r in self.bwd if r.kind == "param" and r.outputs.bad), None)


def _owner(param_name: str, named: dict[str, nn.Module]) -> tuple[str, nn.Module | None]:
    path = param_name.rpartition(".")[0]
    return path, named.get(path)


def replay(
    model: nn.Module,
    compute_loss: Callable[[], Tensor | None],
    *,
    modules: list[tuple[str, nn.Module]],
    forward: bool,
    backward: bool,
    module_backward: bool = True,
) -> tuple[Recorder, Tensor | None]:
    """Run ``compute_loss`` with hooks attached, then backward to the parameters without touching ``.grad``.

    Buffers (BatchNorm statistics) and torchmetrics states updated in the step are restored afterwards, so the
    replay leaves no trace, and the step runs eagerly even if parts of the model
    are compiled, so the hooks fire and nothing is recompiled.

    Args:
        model: the root module (for parameter and buffer names).
        compute_loss: runs the step's forward and returns the loss.
        modules: ``(path, module)`` pairs to hook.
        forward: record forward outputs.
        backward: record gradients.
        module_backward: hook modules' backward as well as parameters (full backward hooks do not allow in-place
            changes of a hooked module's output, as ``nn.ReLU(inplace=True)`` makes).

    Returns:
        The recorder and the replayed loss (detached), or ``None`` if the step returned no loss.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else None
    recorder = Recorder(modules, params, forward=forward, backward=backward, module_backward=module_backward)
    loss: Tensor | None = None
    with preserved(model, rng=False), stance or contextlib.nullcontext(), recorder, recorder.ops, \
            torch.enable_grad(), warnings.catch_warnings(), REPLAYING.scope():
        # Full backward hooks on the first layer warn that its inputs need no grad: expected here.
        warnings.simplefilter("ignore", UserWarning)
        try:
            loss = compute_loss()
            if backward and loss is not None and loss.requires_grad:
                replay_backward(model, loss, [p for _, p in params])
        finally:
            reshard(model)
    return recorder, None if loss is None else loss.detach()


def describe(record: _Record, named: dict[str, nn.Module], phase: str, recorder: Recorder | None = None) -> Origin:
    """The :class:`~lightning_opkit.nan.report.Origin` of a module (or parameter) record.

    Args:
        record: the origin found by a :class:`Recorder`.
        named: ``dict(model.named_modules())``.
        phase: ``"forward"`` or ``"backward"``.
        recorder: the recorder of the replay, whose op counts classify modules of unknown types.
    """
    if record.kind == "param":
        path, module = _owner(record.name, named)
        parameter: str | None = record.name
    else:
        path, module, parameter = record.name, record.module, None
    op_class = recorder.op_class(module) if recorder is not None else (
        classify_module(module) if module is not None else "other")
    return Origin(phase=phase, module=path, module_type=type(module).__name__ if module is not None else "-",
                  op_class=op_class, parameter=parameter, dtype=record.dtype, nan=record.outputs.nan,
                  inf=record.outputs.inf, input_min=record.inputs.min, input_max=record.inputs.max,
                  input_absmax=record.inputs.absmax)


def locate(model: nn.Module, compute_loss: Callable[[], Tensor | None], rng: Any, *,
           modules: list[tuple[str, nn.Module]], forward: bool, backward: bool, loss: bool,
           any_rank: Callable[[bool], bool] = lambda failed: failed) -> Origin | None:
    """Replay one micro-batch with hooks and name where its first non-finite value came from (``None``: not seen).

    The forward origin wins, then the loss, then the backward origin. A replay that fails (the user's step raising
    under hooks) is retried with parameters alone watched in backward, then warned about.

    Args:
        model: the root module.
        compute_loss: runs the step's forward and returns the loss.
        rng: the RNG state the micro-batch started from (set before each replay).
        modules: ``(path, module)`` pairs to hook.
        forward: look for a forward origin.
        backward: look for a backward origin.
        loss: report a non-finite loss whose forward was finite.
        any_rank: whether a replay failed on any rank: every rank retries together, so replays stay in lockstep.
    """
    named = dict(model.named_modules())
    recorder = replayed = None
    failure: Exception | None = None
    # Full backward hooks refuse models that modify a hooked output in place (ReLU(inplace=True));
    # then parameters alone are watched in backward.
    for module_backward in (True, False):
        set_rng_state(rng)
        recorder = None
        try:
            recorder, replayed = replay(model, compute_loss, modules=modules, forward=forward, backward=backward,
                                        module_backward=module_backward)
        except Exception as err:  # the user's step itself may fail too: report without a module
            failure = err
        if not any_rank(recorder is None):
            break
    if recorder is None:
        warn_once(f"NaNDetector could not replay the step to localize the non-finite value: {failure}",
                  key=("nan", "localization failed"),
                      stacklevel=3)
        return None
    origin = recorder.forward_origin() if forward else None
    if origin is not None:
        return dataclasses.replace(describe(origin, named, "forward", recorder), seq=recorder.fwd.index(origin))
    if replayed is not None and not bool(replayed.float().isfinite().all()) and (loss or not forward):
        return Origin(phase="loss", module="", module_type=type(model).__name__, op_class="loss",
                      dtype=full_name(replayed.dtype), nan=int(replayed.isnan().sum()),
                      inf=int(replayed.isinf().sum()), seq=len(recorder.fwd))
    origin = recorder.backward_origin() if backward else None
    if origin is None:
        return None
    seq = len(recorder.fwd) + 1 + recorder.bwd.index(origin)
    return dataclasses.replace(describe(origin, named, "backward", recorder), seq=seq)


# Why: the cause ladder (see the module's docstring).


class ReplayFailed(Exception):
    """A cause replay could not run: the fault can be neither seen nor ruled out."""


def climb(reproduced: Callable[[bool], bool], lowered: bool) -> str:
    """The cause ladder: ``"transient"``, ``"precision"`` or ``"data_or_model"``, from at most two replays.

    Args:
        reproduced: replays the step (``True``: the culprit in fp32; ``False``: as it ran) and says whether the fault
            came back; raises :class:`ReplayFailed` when the replay could not run.
        lowered: the step runs in a lower precision somewhere (else the fp32 replay would repeat the first).

    Example:
        >>> climb(lambda fp32: not fp32, lowered=True), climb(lambda fp32: True, lowered=False)
        ('precision', 'data_or_model')
    """
    if not reproduced(False):
        return "transient"
    if lowered and not reproduced(True):
        return "precision"
    return "data_or_model"

#: ``(autocast on?) -> compute_loss``: the step's loss, replayed on the micro-batch
StepLoss = Callable[[bool], Callable[[], Tensor | None]]


def diagnose(step_loss: StepLoss, model: nn.Module, rng: Any, found: Origin, named: dict[str, nn.Module],
             policies: list[Any], batch_idx: int, agree: Callable[[Any], Any] = lambda outcome: outcome,
             compiled: bool = False) -> Cause:
    """The :class:`~lightning_opkit.nan.report.Cause` of the fault ``found`` (a localization), from two replays.

    Args:
        step_loss: builds the replayed step's loss.
        model: the LightningModule.
        rng: the RNG state the step started from.
        found: where the localization replay saw it.
        named: ``named_modules()`` of the model.
        policies: the PrecisionPolicy callbacks attached (their ``running_in`` puts the culprit in fp32).
        batch_idx: the batch's index, for the advice.
        agree: the culprit rank's outcome of each replay, on every rank: every rank replays its own micro-batch
            with the same module in fp32, and the culprit's outcome decides what runs next, so the replays stay in
            lockstep (an FSDP2 forward all-gathers on every rank).
        compiled: the step ran compiled (replays run eagerly): said in a ``transient`` cause.
    """
    path = found.module
    culprit = named.get(path) if path else None
    where = f"module {path!r}" if culprit is not None else "the whole step"

    def reproduced(fp32: bool) -> bool:
        again, failure = agree(_non_finite_again(step_loss, model, rng, found, culprit, policies, fp32=fp32))
        if failure is not None:
            raise ReplayFailed(failure)
        return bool(again)

    try:
        cause = climb(reproduced, lowered=True)
    except ReplayFailed as failed:
        return Cause("unknown", f"a replay to tell the cause failed ({failed}), so it was not observed")
    if cause == "transient":
        return not_reproduced(compiled, by_replay_as_is=True)
    if cause == "precision":
        fix = (f"PrecisionPolicy(overrides={{{path!r}: 'fp32'}})" if culprit is not None
               else "running the model in fp32 (Trainer(precision='32-true'), no PrecisionPolicy lowering)")
        return Cause("precision", f"finite with {where} in fp32, non-finite as is: try {fix}")
    return Cause("data_or_model", f"non-finite with {where} in fp32 too: check batch {batch_idx}'s data and the"
                                  f" model's numerics (learning rate, log/division of zero, initialization)")


def _non_finite_again(step_loss: StepLoss, model: nn.Module, rng: Any, found: Origin,
                      culprit: nn.Module | None, policies: list[Any], fp32: bool) -> tuple[bool, str | None]:
    """Replay the micro-batch (the culprit, else the whole step, in fp32 if asked): :func:`replay_in`.

    Returns ``(fault there again?, why the replay failed or None)``.
    """
    outputs: list[Tensor] = []
    handle = None
    if culprit is not None and found.phase == "forward":
        # registered before the fp32 region's hooks: after the module's own forward hooks (the localization saw the
        # output they hand on, which a user's hook may change) and before the cast back for the next modules
        handle = culprit.register_forward_hook(lambda m, a, out: outputs.extend(local_floats(out)))
    try:
        loss, grads = replay_in(step_loss, model, rng, culprit, policies, fp32=fp32,
                                backward=found.phase == "backward")
    except Exception as err:  # the step failing in a replay: the fault can be neither seen nor ruled out
        warn_once(f"NaNDetector: a cause replay failed ({describe_error(err)})", key=("nan", "cause replay failed"),
                  stacklevel=3)
        return True, describe_error(err)
    finally:
        if handle is not None:
            handle.remove()
    if found.phase == "forward" and culprit is not None:
        return not all(bool(t.isfinite().all()) for t in outputs), None
    if found.phase == "backward":
        return not all(bool(g.isfinite().all()) for g in grads if g is not None), None
    return loss is not None and not bool(loss.float().isfinite().all()), None


def replay_in(step_loss: StepLoss, model: nn.Module, rng: Any, culprit: nn.Module | None, policies: list[Any], *,
              fp32: bool, backward: bool) -> tuple[Tensor | None, list[Tensor | None]]:
    """Replay a micro-batch from ``rng``, with ``culprit`` in fp32 (``None``: the whole step), or as it ran.

    The one replay NaN faults and spikes are both diagnosed by. In fp32: through every attached policy
    (``running_in``), and the culprit's own 16-bit weights where no policy runs it (its outputs handed on in the dtype
    the next modules take); the whole step without autocast, and, with 16-bit weights, every top module on fp32
    copies of them. Hooks a caller registered on the culprit before this call run before the fp32 region's.

    Args:
        step_loss: builds the replayed step's loss (``autocast on?``).
        model: the LightningModule.
        rng: the RNG state the micro-batch started from.
        culprit: the module to run in fp32, or ``None`` for the whole step.
        policies: the attached precision policies.
        fp32: run the culprit (or the step) in fp32; ``False``: as the step ran.
        backward: compute the gradients too.

    Returns:
        The loss and the gradients, as :func:`~lightning_opkit.core.replay.run_step` returns them.
    """
    set_rng_state(rng)
    with contextlib.ExitStack() as stack:
        if fp32:
            for policy in policies:
                stack.enter_context(policy.running_in(culprit, "fp32"))
            if culprit is not None:
                stack.enter_context(in_fp32(culprit, weights=not policies, cast_back=True))
            elif has_low_weights(model):  # 16-bit weights: every top module computes on fp32 copies
                for child in model.children():
                    stack.enter_context(in_fp32(child, weights=True, cast_back=False))
        return run_step(model, step_loss(not (fp32 and culprit is None)), backward=backward)
