"""Run a training step again without leaving a trace: buffers, metric states and the RNG put back, logging silenced.

Both slow paths that re-run a user's step use this: NaNDetector's localization and cause replays, and
PrecisionPolicy's measurement runs. :func:`training_loss` runs the user's ``training_step`` as a loss function:
nothing logged, stepped or counted, under manual optimization too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_opkit.core.fsdp import fully_sharded, reshard
from lightning_opkit.core.lightning_compat import attached_trainer, metric_state_names, wrapped_optimizers
from lightning_opkit.core.patch import Nesting, Patches

_METRIC_BOOKKEEPING = ("_update_count", "_computed", "_forward_cache", "_update_called")
#: inside a re-run of the current training step (see :func:`replaying`)
REPLAYING = Nesting()


def replaying() -> bool:
    """Whether opkit is re-running the current training step right now, not training on it.

    True inside PrecisionPolicy's measurement runs (``rules="auto"``) and NaNDetector's localization and cause
    replays. Code in a ``training_step`` or a forward hook with side effects (counters, logging to files, queues) can
    skip them there. Weights, buffers, metric states and the RNG are put back after every such run.

    Example:
        >>> from lightning_opkit import replaying
        >>> replaying()
        False
    """
    return bool(REPLAYING)


def rng_state() -> tuple[Tensor, Any]:
    """The CPU (and, once initialized, CUDA) RNG state."""
    # is_initialized() alone, not is_available(): under Lightning's PYTORCH_NVML_BASED_CUDA_CHECK=1 each
    # is_available() of a CUDA build goes through ctypes and leaves reference cycles, and this runs every step
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple[Tensor, Any]) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _metric_state(metric: Metric) -> dict[str, Any]:
    """What a torchmetrics ``update`` changes: states (copied: updates are in place) and bookkeeping."""
    state = {k: copy.deepcopy(vars(metric)[k]) for k in metric_state_names(metric) if k in vars(metric)}
    state.update({k: vars(metric)[k] for k in _METRIC_BOOKKEEPING if k in vars(metric)})
    return state


@contextlib.contextmanager
def preserved(model: nn.Module, rng: bool = True) -> Iterator[Callable[[], None]]:
    """Inside, ``model``'s buffers and torchmetrics states (and the RNG) may change; on exit they are put back.

    Yields a function that puts them back at any time (between two runs of the same step).

    Args:
        model: the root module.
        rng: also save and restore the RNG state.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> with preserved(bn):
        ...     _ = bn(torch.randn(4, 2))
        >>> bn.running_mean.tolist()
        [0.0, 0.0]
    """
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    metrics = [(m, _metric_state(m)) for m in model.modules() if isinstance(m, Metric)]
    state = rng_state() if rng else None

    def reset() -> None:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for metric, saved_state in metrics:
            vars(metric).update(saved_state)
        if state is not None:
            set_rng_state(state)

    try:
        yield reset
    finally:
        reset()


@contextlib.contextmanager
def quiet_logging(module: nn.Module) -> Iterator[None]:
    """Inside, ``module.log`` and ``module.log_dict`` do nothing: a re-run step must not log twice."""
    patches = Patches()
    patches.set(module, "log", lambda *args, **kwargs: None)
    patches.set(module, "log_dict", lambda *args, **kwargs: None)
    try:
        yield
    finally:
        patches.restore()


def loss_of(output: Any) -> Tensor | None:
    """The loss in what a step or a model returned: a tensor, a dict's ``"loss"``, or an object's ``.loss``."""
    if isinstance(output, dict):
        output = output.get("loss")
    elif not isinstance(output, Tensor) and isinstance(getattr(output, "loss", None), Tensor):
        output = output.loss
    return output if isinstance(output, Tensor) else None


def replay_backward(model: nn.Module, loss: Tensor, params: Sequence[Tensor]) -> list[Tensor | None]:
    """The gradients of ``loss`` for ``params``, leaving every ``.grad`` as it was.

    On a plain, DDP or tensor-parallel model that is ``torch.autograd.grad`` (DDP's reducer is not involved). Under
    FSDP2 the sharded parameters are not in the graph (the forward ran on all-gathered copies), so ``autograd.grad``
    would run no backward at all: no backward hook, no reduce-scatter, and the root's parameters left unsharded. There
    the replay runs a real ``backward`` on every rank (the caller keeps ranks in lockstep) with the step's gradients
    set aside, and returns the reduced gradient shards.

    Args:
        model: the root module.
        loss: the replayed loss.
        params: the parameters (trainable, in a fixed order).

    Example:
        >>> w = nn.Parameter(torch.ones(2))
        >>> w.grad = torch.zeros(2)
        >>> replay_backward(nn.Linear(1, 1), (w * 3).sum(), [w]), w.grad
        ([tensor([3., 3.])], tensor([0., 0.]))
    """
    if not fully_sharded(model):
        return list(torch.autograd.grad(loss, params, allow_unused=True))
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        loss.backward()
        return [p.grad for p in params]
    finally:
        for p, grad in zip(params, saved):
            p.grad = grad


def run_step(model: nn.Module, compute_loss: Callable[[], Tensor | None], backward: bool = True,
             loss_scale: float | None = None) -> tuple[Tensor | None, list[Tensor | None]]:
    """Run a step's loss (and its gradients, without touching ``.grad``) eagerly, then put the buffers back.

    Args:
        model: the root module.
        compute_loss: runs the step's forward and returns the loss.
        backward: also compute the parameters' gradients.
        loss_scale: differentiate ``loss * loss_scale`` and unscale the gradients in fp32, as a GradScaler does: fp16
            gradients that would underflow unscaled come out as training would see them.

    Returns:
        The detached loss (``None`` if the step returned none) and one gradient (or ``None``) per trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with preserved(model, rng=False), torch.compiler.set_stance("force_eager"), torch.enable_grad(), \
            REPLAYING.scope():
        try:
            loss = compute_loss()
            grads: list[Tensor | None] = [None] * len(params)
            if backward and loss is not None and loss.requires_grad and params:
                scaled = loss if loss_scale is None else loss * loss_scale
                grads = replay_backward(model, scaled, params)
                if loss_scale is not None:
                    grads = [None if g is None else g.float() / loss_scale for g in grads]
        finally:
            reshard(model)
    return (None if loss is None else loss.detach()), grads


# The user's training step as a loss function: nothing logged, nothing stepped, nothing counted.
#
# Every slow path that re-runs the user's step goes through `training_loss`. Under automatic optimization the loss is
# what ``training_step`` returns. Under manual optimization ``training_step`` trains by itself, so inside
# `training_loss` its ``manual_backward`` records the loss instead of running backward, and ``optimizer.step`` (a
# closure passed to it still runs: it computes the loss), ``zero_grad``, ``clip_gradients`` and the LR schedulers'
# ``step`` do nothing: no weight, optimizer state, gradient, LR or ``global_step`` moves.


def _held_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
    return closure() if closure is not None else None


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def held_training(pl_module: nn.Module) -> Iterator[list[Tensor]]:
    """Inside, a manually optimized LightningModule's step computes its loss but trains nothing.

    Yields the losses handed to ``manual_backward`` inside, in order (empty under automatic optimization, where
    nothing is held: ``training_step`` does not step there).

    Args:
        pl_module: the LightningModule (any other module: nothing is held).

    Example:
        >>> import torch
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> model = BoringModel()
        >>> model.automatic_optimization = False
        >>> with held_training(model) as losses:
        ...     model.manual_backward(torch.tensor(2.0, requires_grad=True))
        >>> losses
        [tensor(2., requires_grad=True)]
    """
    losses: list[Tensor] = []
    if getattr(pl_module, "automatic_optimization", True):
        yield losses
        return
    patches = Patches()
    patches.set(pl_module, "manual_backward", lambda loss, *args, **kwargs: losses.append(loss))
    patches.set(pl_module, "clip_gradients", _nothing)
    trainer = attached_trainer(pl_module)
    if trainer is not None:
        # The wrappers ``self.optimizers()`` returns count ``global_step`` in their own ``step``; the raw optimizers
        # (``use_pl_optimizer=False``) are held too. ``zero_grad`` would erase the gradients of the step being
        # checked. A held step still runs a closure passed to it: that is where such a step computes its loss.
        for optimizer in [*wrapped_optimizers(trainer), *trainer.optimizers]:
            patches.set(optimizer, "step", _held_step)
            patches.set(optimizer, "zero_grad", _nothing)
        for config in trainer.lr_scheduler_configs:
            patches.set(config.scheduler, "step", _nothing)
    try:
        yield losses
    finally:
        patches.restore()


def training_loss(pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                  training_step: Callable[..., Any] | None = None) -> Tensor | None:
    """The loss of ``pl_module``'s training step on ``batch``, computed without training on it.

    Under manual optimization, the sum of the losses the step handed to ``manual_backward`` (its gradients are what
    those backward calls would have accumulated), else what it returned.

    Args:
        pl_module: the LightningModule.
        batch: the batch.
        batch_idx: its index.
        training_step: the step to run (default ``pl_module.training_step``): the user's own, where a callback has
            wrapped it.

    Returns:
        The loss, or ``None`` when the step gave none.

    Example:
        >>> import torch
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> model = BoringModel()
        >>> training_loss(model, torch.ones(2, 32), 0).shape
        torch.Size([])
    """
    step = training_step if training_step is not None else pl_module.training_step
    with quiet_logging(pl_module), held_training(pl_module) as backwards:
        output = step(batch, batch_idx)
    if backwards:
        total = backwards[0]
        for loss in backwards[1:]:
            total = total + loss
        return total
    return loss_of(output)
