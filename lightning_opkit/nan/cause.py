"""Why a step went non-finite (or spiked): replays as is and with the culprit in fp32 tell the cause.

One ladder, :func:`climb`, for NaN faults and loss spikes alike, always in this order: the step replayed **as is**
(not reproduced: ``transient``), then, where the step runs in a lower precision somewhere, with the culprit **in
fp32** (gone: ``precision``), else ``data_or_model``. A NaN fault counts every step as lowered (the fp32 replay is
what tells the reader "in fp32 too"); a spike only a step that runs in 16-bit somewhere.

- ``precision``: finite with the culprit in fp32, non-finite as is (a 16-bit overflow or underflow).
- ``data_or_model``: non-finite in fp32 too (the batch, a log of zero, a learning rate that diverged).
- ``transient``: not reproduced by a second replay as is (non-deterministic code or hardware).
- ``unknown``: a replay failed, so the cause could not be observed; the reason says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from lightning_opkit.core.fp32 import has_low_weights, in_fp32
from lightning_opkit.core.ranks import local_floats
from lightning_opkit.core.replay import run_step, set_rng_state
from lightning_opkit.core.text import describe_error
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.report import Cause, Origin, not_reproduced

__all__ = ["ReplayFailed", "climb", "diagnose", "replay_in"]


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
