"""NaNDetector's per-step check: the loss and every gradient, one multi-tensor pass, one collective, one host sync."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_opkit.core.dtypes import full_name
from lightning_opkit.core.ranks import local
from lightning_opkit.core.torch_compat import foreach_non_finite_check_, foreach_norm
from lightning_opkit.nan.report import Origin
from lightning_opkit.opclass import classify_module

__all__ = ["FINITE_ONLY_ELEMENTS", "OUTCOMES", "Checked", "FiniteOnly", "Outcome", "all_finite", "bad_gradient_shard",
           "check", "check_step", "finite_only", "flags", "log_values", "outcome", "read"]


def all_finite(tensors: list[Tensor]) -> Tensor:
    """Whether every element of every tensor is finite, as a 0-d bool tensor on the device (no host sync).

    Example:
        >>> all_finite([torch.ones(2), torch.tensor([1.0, float("inf")])])
        tensor(False)
    """
    # One fused multi-tensor kernel on CUDA; on CPU a loop of small norms, measured cheaper (0.3 ms/step on the
    # example) than concatenating the gradients first. A NaN or Inf anywhere makes its norm non-finite; the norms are
    # taken in fp32, since in a 16-bit gradient's own dtype a finite norm past 65504 (fp16) would overflow. Even fp32
    # overflows for a finite gradient past ~1e19 per element: :func:`check` confirms a failed check exactly.
    norms = foreach_norm(tensors, 2, dtype=_norm_dtype(tensors))
    return torch.stack(norms).isfinite().all()


_DTYPE = operator.attrgetter("dtype")


def _norm_dtype(tensors: list[Tensor]) -> torch.dtype:
    """fp32, or fp64 where a tensor is fp64: a norm's dtype may widen its input's, never narrow it."""
    # map() over a C-level getter: the norms path runs this on every checked step, once per gradient
    return torch.float64 if torch.float64 in map(_DTYPE, tensors) else torch.float32


@dataclass(frozen=True)
class Checked:
    """What one checked step found, the same on every rank (after the one collective and the one sync).

    Args:
        loss_bad: a loss was non-finite on some rank.
        grad_bad: a gradient was non-finite on some rank.
        values: the step's log-loss and log-gradient-norm, their maximum over ranks (on the host): what a spike is
            scored on, and what enters the window if the step is good.
        local: this rank's own loss and gradient norm (on the device; read only after a spike).
        norms: this rank's per-gradient norms (on the device), in ``grads`` order.
        dead: the ``dead`` flag was set on some rank: a watched parameter went without a gradient long enough.
    """

    loss_bad: bool
    grad_bad: bool
    values: tuple[float, float] = (0.0, 0.0)
    local: Tensor | None = None
    norms: Tensor | None = None
    dead: bool = False


_CLEAN = Checked(False, False)  # frozen: one value serves every healthy step the quick check tells


#: what a checked step turned out to be, the one decision NaNDetector's hook dispatches on
OUTCOMES = ("healthy", "spike", "scaler overflow", "non-finite")


@dataclass(frozen=True)
class Outcome:
    """What a checked step is (one of :data:`OUTCOMES`), with what acting on it needs.

    Args:
        kind: one of :data:`OUTCOMES`.
        spiked: on a spike, what spiked: ``"loss"`` or ``"gradient"``.
        scores: the step's loss and gradient-norm scores, where spikes are scored (a good step's enter the window).
        scale: on a scaler overflow, the GradScaler's scale after it (read then only: a sync).
    """

    kind: str
    spiked: str | None = None
    scores: tuple[float, float] = (0.0, 0.0)
    scale: float | None = None


_HEALTHY = Outcome("healthy")  # frozen: one value serves every healthy step


def outcome(checked: Checked, score: Callable[[Checked], tuple[str | None, tuple[float, float]]] | None,
            scaler: Any, forward_fault: Callable[[], bool]) -> Outcome:
    """What a checked step is, from what its check found: the one place that sorts a step.

    Args:
        checked: the check's findings.
        score: scores a finite step for spikes: ``(what spiked or None, (loss score, gradient score))``
            (:meth:`~lightning_opkit.nan.spike_report.Spikes.judge`); ``None``: spikes are not looked for.
        scaler: the GradScaler that scales the loss (fp16 under ``16-mixed``), or ``None``.
        forward_fault: replays the forwards and says whether a module's output went non-finite; asked only for
            non-finite gradients beside a finite loss under a GradScaler.

    Example:
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        >>> outcome(Checked(False, True), None, scaler, forward_fault=lambda: False)
        Outcome(kind='scaler overflow', spiked=None, scores=(0.0, 0.0), scale=1024.0)
        >>> outcome(Checked(False, True), None, None, forward_fault=lambda: False).kind
        'non-finite'
        >>> outcome(Checked(False, False), lambda checked: ("loss", (9.0, 0.5)), None, lambda: False).kind
        'spike'
    """
    if checked.loss_bad or checked.grad_bad:
        # fp16 loss scaling overflows the backward on purpose (the scaler skips that step and lowers the scale); loss
        # scaling cannot make a forward activation non-finite, so such a step is a fault of its own
        if scaler is not None and not checked.loss_bad and not forward_fault():
            return Outcome("scaler overflow", scale=float(scaler.get_scale()))
        return Outcome("non-finite")
    if score is None:
        return _HEALTHY
    spiked, scores = score(checked)
    return Outcome("healthy" if spiked is None else "spike", spiked, scores)


def check(losses: list[Tensor], grads: list[Tensor], device: torch.device,
          dead: Callable[[Tensor | None], Tensor] | None = None, norms: bool = True,
          quick: Callable[[list[Tensor], list[Tensor]], Tensor | None] | None = None) -> Checked:
    """The checked step's one collective and one sync: non-finite flags, and the values spikes are scored on.

    Gradients are checked where they live: a sharded gradient (a DTensor under FSDP2 or tensor parallel) by its
    local shard, so the check costs no all-gather, and the one ``all_reduce`` (of the loss, the gradient norm and the
    dead flag, their maximum over ranks) tells every rank the same.

    Args:
        losses: the step's (micro-batch) losses, detached copies (:func:`finite_only` writes them, unchanged).
        grads: the gradients to check; empty to check none.
        device: where to compute the flags when there is nothing to check.
        dead: the dead-parameter flag from the per-gradient norms (a 1-element tensor on the device,
            :meth:`~lightning_opkit.nan.dead.DeadWatch.flag`), reduced and read with the others.
        norms: the gradient norms are wanted (spikes are scored on them). ``False``, without ``dead``: a healthy
            step is told by whether anything is non-finite, which on CPU costs less (:func:`finite_only`), and its
            ``values`` are zeros.
        quick: that cheaper check, kept across a fit's steps (a :class:`FiniteOnly`); ``None``: :func:`finite_only`.

    Example:
        >>> checked = check([torch.tensor(1.0)], [torch.tensor([float("nan")])], torch.device("cpu"))
        >>> checked.loss_bad, checked.grad_bad
        (False, True)
    """
    if not norms and dead is None:
        found = (quick or finite_only)(losses, grads)
        if found is not None and not found.tolist()[0]:  # a healthy step's one host sync
            return _CLEAN
        # past here a step found non-finite is checked in full, a slow path as its replays are
    found, own, per_grad = flags(losses, grads, device, dead)
    loss, grad_norm, flagged = read(found.tolist())  # the one host sync of a checked step
    grad_bad = math.isinf(grad_norm) and _exactly_non_finite([g for g in (local(g) for g in grads)
                                                              if not g.is_sparse])
    return Checked(math.isinf(loss), grad_bad, log_values(loss, grad_norm), own, per_grad, flagged)


def log_values(loss: float, grad_norm: float) -> tuple[float, float]:
    """What a spike is scored on: the loss and the gradient norm, each on a log scale.

    The loss through ``sign(x) * log1p(|x|)``, the log of a large loss and defined for a small or negative one; the
    gradient norm through its log (a zero norm scores as very small, not as -inf).

    Example:
        >>> [round(v, 4) for v in log_values(-1.0, 1.0)], round(log_values(8.7, 0.0)[0], 4)
        ([-0.6931, 0.0], 2.2721)
    """
    return math.copysign(math.log1p(abs(loss)), loss), math.log(grad_norm + 1e-30)


def read(found: list[float]) -> tuple[float, float, bool]:
    """``(loss, gradient norm, dead flag)`` from :func:`flags`' ``found`` on the host; +inf where non-finite.

    Example:
        >>> read([2.0, float("inf")])
        (2.0, inf, False)
    """
    return found[0], found[1], len(found) > 2 and found[2] > 0


def flags(losses: list[Tensor], grads: list[Tensor], device: torch.device,
          dead: Callable[[Tensor | None], Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """:func:`check`'s reduction, left on the device: nothing is read on the host.

    A handful of device ops, since on a small model each costs more host time than its arithmetic: one fused norm
    per gradient, their norm, and the loss beside it. A NaN or Inf anywhere makes its norm non-finite; non-finite
    values are sent as +inf, so that the maximum over ranks keeps them (a collective's maximum of a NaN is undefined)
    and the host tells them from any finite value.

    Returns:
        ``found`` (the mean loss, the gradient norm and, with ``dead``, its flag: their maximum over ranks, +inf where
        non-finite; :func:`read` unpacks it), this rank's own loss and gradient norm, and its per-gradient norms.

    Example:
        >>> found, _, _ = flags([torch.tensor(1.0)], [torch.tensor([float("nan")])], torch.device("cpu"))
        >>> found.tolist()
        [1.0, inf]
    """
    grads = _plain(grads)
    loss = _mean_loss(losses, grads, device)
    device = loss.device
    # One fused multi-tensor kernel on CUDA. The norms are taken in fp32: in a 16-bit gradient's own dtype a finite
    # norm past 65504 (fp16) would overflow. fp64 gradients (``precision="64-true"``) keep theirs.
    norms = torch.stack(foreach_norm(grads, 2, dtype=_norm_dtype(grads))) if grads else None
    grad_norm = torch.linalg.vector_norm(norms) if norms is not None else torch.zeros((), device=device)
    own = torch.stack([loss, grad_norm.float()])
    found = own.nan_to_num(nan=math.inf, posinf=math.inf, neginf=math.inf)  # a copy: ``own`` stays this rank's
    if dead is not None:
        found = torch.cat([found, dead(norms).to(device)])
    return _any_rank(found), own, norms


#: on CPU, gradients of up to this many elements in all are checked by :func:`finite_only`; past it, a norm per
#: gradient reads them once where the in-place pass reads and writes them (``benchmarks/overhead.py --suite
#: nan_check`` measures both across sizes)
FINITE_ONLY_ELEMENTS = 1 << 22
_IS_CPU, _REQUIRES_GRAD = operator.attrgetter("is_cpu"), operator.attrgetter("requires_grad")
_ONE = torch.ones(())  # the unscale's factor: the gradients are rewritten as they are


def finite_only(losses: list[Tensor], grads: list[Tensor]) -> Tensor | None:
    """A 1-element flag, 1.0 where a loss or a gradient is non-finite on some rank, 0.0 elsewhere; where it is cheaper.

    On CPU a norm per gradient is a separate kernel each (about a microsecond of host time apiece): GradScaler's
    in-place check over all of them and the losses is one call, exact (no norm can overflow), and writes each tensor
    back unchanged (a multiply by 1.0). ``None`` where that does not apply or costs more: a tensor off the CPU (one
    fused norm kernel there, which only reads), past :data:`FINITE_ONLY_ELEMENTS`, one in an autograd graph (a
    ``create_graph`` backward: an in-place write would break its later backward), a shard (a DTensor), sparse, or of a
    dtype the check does not take (complex). A fit's steps use a :class:`FiniteOnly`, which works out once what
    does not change between them.

    Args:
        losses: the step's losses, copies of the training step's own (they are written, unchanged).
        grads: the gradients.

    Example:
        >>> finite_only([torch.tensor(2.0)], [torch.ones(3), torch.tensor([1.0, float("nan")])]).tolist()
        [1.0]
    """
    return FiniteOnly()(losses, grads)


class FiniteOnly:
    """:func:`finite_only` across one fit's steps, with what they do not change worked out once.

    A step's gradients are its parameters': their types, devices and sizes are looked at again only when their
    count changes (a tensor that would still not do makes the multi-tensor check raise, and the full check runs
    instead). Whether ranks are joined is read at the first step, once the process group exists; the flag's storage
    is allocated once. In a training step's hooks every lookup runs with cold caches, at several times its warm cost.

    Example:
        >>> quick = FiniteOnly()
        >>> bad = torch.tensor([0.0, float("-inf")])
        >>> [quick([torch.tensor(2.0)], [torch.ones(3), g]).tolist() for g in (torch.ones(2), bad)]
        [[0.0], [1.0]]
    """

    def __init__(self) -> None:
        self._count, self._fits = -1, False
        self._found = torch.zeros(1)
        self._joined: bool | None = None

    def __call__(self, losses: list[Tensor], grads: list[Tensor]) -> Tensor | None:
        """The flag for this step's ``losses`` and ``grads`` (:func:`finite_only`)."""
        tensors = [*grads, *losses]
        if len(tensors) != self._count:
            # map() over C-level getters. A shard (DTensor) is left to the full check, which reads its local part
            self._count, self._fits = len(tensors), bool(tensors) and set(map(type, tensors)) == {Tensor} and all(
                map(_IS_CPU, tensors)) and sum(map(Tensor.numel, tensors)) <= FINITE_ONLY_ELEMENTS
        if not self._fits or any(map(_REQUIRES_GRAD, tensors)):
            return None
        found = self._found.zero_()
        try:
            foreach_non_finite_check_(tensors, found, _ONE)
        except (RuntimeError, NotImplementedError):  # sparse or complex gradients, one whose elements overlap
            return None
        if self._joined is None:
            self._joined = _joined()
        return _any_rank(found, self._joined)


def _plain(grads: list[Tensor]) -> list[Tensor]:
    """The gradients as this rank holds them, dense and non-empty."""
    # a plain gradient (the usual case) skips local()'s look for a shard: this runs once per gradient and step
    return [g for g in (g if type(g) is Tensor else local(g) for g in grads) if not g.is_sparse and g.numel()]


def _mean_loss(losses: list[Tensor], grads: list[Tensor], device: torch.device) -> Tensor:
    """The step's loss in fp32: its micro-batches' mean (zero if none), on their device."""
    losses = [local(x).float() for x in losses]
    if len(losses) == 1 and losses[0].dim() == 0:
        return losses[0]
    device = losses[0].device if losses else grads[0].device if grads else device
    return torch.cat([x.reshape(-1) for x in losses]).mean() if losses else torch.zeros((), device=device)


def check_step(losses: list[Tensor], grads: list[Tensor], device: torch.device) -> tuple[bool, bool]:
    """``(loss non-finite, gradients non-finite)`` on any rank (:func:`check` without spike scores).

    Example:
        >>> check_step([torch.tensor(1.0)], [torch.tensor([float("nan")])], torch.device("cpu"))
        (False, True)
    """
    checked = check(losses, grads, device)
    return checked.loss_bad, checked.grad_bad


def _exactly_non_finite(grads: list[Tensor]) -> bool:
    """The slow path after a failed norm check, on every rank alike (each saw the same flags).

    Element by element, so that a norm overflowing fp32 on finite values (past ~1e19 per element) is not a fault.
    """
    exact = torch.stack([~g.isfinite().all() for g in grads]).any() if grads else torch.zeros((), dtype=torch.bool)
    return bool(_any_rank(exact.float().reshape(1)).item() > 0)


def _joined() -> bool:
    return dist.is_available() and dist.is_initialized()


def _any_rank(flags: Tensor, joined: bool | None = None) -> Tensor:
    """``flags``' maximum over ranks, in place; ``joined``: whether ranks are joined, if already known."""
    if _joined() if joined is None else joined:
        # Every rank takes the same decision at the same step, so none waits in a collective alone.
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags


def bad_gradient_shard(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Origin | None:
    """The sharded parameter whose gradient shard here went non-finite first in backward, if any.

    First in backward is taken as last in ``named_parameters`` order (modules register in forward order), so a fault
    in the middle of the model is named at its module, not at the input layer its NaN flowed back to.

    A slow-path helper (it syncs per parameter): under FSDP2 or tensor parallel a parameter's gradient is reduced
    into its shard outside autograd, so the step's own shards are where a bad parameter gradient can be seen.

    Args:
        model: the root module (its parameter names).
        optimizer: the optimizer whose parameters to look at.
    """
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_modules())
    for name, param in reversed(list(model.named_parameters())):
        if id(param) not in stepped or param.grad is None or type(param).__name__ != "DTensor":
            continue  # a plain parameter's gradient is seen by a replay's hooks
        grad = local(param.grad)
        if grad.is_sparse or bool(grad.isfinite().all()):
            continue
        path = name.rpartition(".")[0]
        module = named.get(path)
        return Origin(phase="backward", module=path, module_type=type(module).__name__ if module is not None else "-",
                      op_class=classify_module(module) if module is not None else "other", parameter=name,
                      dtype=full_name(grad.dtype), nan=int(grad.isnan().sum()), inf=int(grad.isinf().sum()))
    return None
