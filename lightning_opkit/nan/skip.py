"""Leave an optimizer step out: NaNDetector's skip, and the one place that answers "what happens on a skipped step".

Per batch the :class:`StepSkipper` moves through :class:`BatchState`:

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
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_opkit.core.patch import Patches

__all__ = ["BatchState", "StepSkipper", "with_found_inf"]


def with_found_inf(optimizer: torch.optim.Optimizer, found_inf: Tensor, step: Any, **kwargs: Any) -> Any:
    """Run ``step(**kwargs)`` with ``found_inf`` handed to the optimizer, as a GradScaler hands it, and take it back.

    Args:
        optimizer: a fused optimizer (:func:`~lightning_opkit.nan.device.takes_found_inf`).
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
            self._scaler_state = [t.clone() for t in self._scaler_tensors()]
        if checking and save_buffers and self._buffers:
            # One multi-tensor copy into storage allocated once, no host sync: BatchNorm statistics are written in
            # the forward, before any check can run.
            if len(self._saved) != len(self._buffers):
                self._saved = [torch.empty_like(b) for b in self._buffers]
            torch._foreach_copy_(self._saved, self._buffers)

    def end_batch(self) -> None:
        """At a batch's end: under manual optimization, a left-out step's LR schedules put back."""
        skipped = self.state in (BatchState.SKIP_PENDING, BatchState.SKIPPED)
        if self._schedules and self.step_left_out:
            self._restore_schedules()
        if self._scaler_state and skipped:
            # the GradScaler saw the bad gradients too and lowered its scale: not for an overflow, so put it back
            torch._foreach_copy_(self._scaler_tensors(), self._scaler_state)
        self._schedules, self._scaler_state = [], []

    def watch_buffers(self, buffers: list[Tensor]) -> None:
        """The buffers a skipped step puts back."""
        self._buffers = [b for b in buffers if not b.is_sparse]
        self._saved = []

    def restore_buffers(self) -> None:
        """Put back the buffers saved at the start of this optimizer step."""
        if self._saved:
            with torch.no_grad():
                torch._foreach_copy_(self._buffers, self._saved)

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

    def _scaler_tensors(self) -> list[Tensor]:
        # torch.amp.GradScaler's own state, made at its first scale(); the rest is rebuilt at every update()
        tensors = (getattr(self._scaler, "_scale", None), getattr(self._scaler, "_growth_tracker", None))
        return [t for t in tensors if isinstance(t, Tensor)]

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

        if hasattr(step, "_wrapped_by_lr_sched"):
            # torch's LR schedulers warn that optimizer.step was overridden unless the step they wrapped is marked.
            skippable_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
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
