"""Gradient health: parameters, and experts of fused Mixture-of-Experts weights, that stop receiving a gradient.

A parameter the optimizer steps that has no gradient, or an all-zero one, over ``after`` checked steps in a row is
named once, with its module: a layer frozen by mistake, a branch the forward no longer takes, a gate trained through
``topk`` indices (no gradient flows through an index). A fused expert weight (a 3-D parameter outside a convolution,
experts along its first dimension) is watched expert by expert, so an expert no token is routed to is named by its
index while the others train.

On a checked step this costs a few small reductions on the device (the per-parameter gradient norms are the check's
own) and one more flag in the check's one ``all_reduce``: the counts are read only once a count reaches ``after``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.ranks import local
from lightning_opkit.core.torch_compat import ConvNd
from lightning_opkit.core.warn import warn_once
from lightning_opkit.opclass import classify_module

if TYPE_CHECKING:
    from lightning_opkit.core.logging import LogWriter

__all__ = ["COLUMNS", "Dead", "DeadWatch", "write_dead"]


@dataclass(frozen=True)
class Dead:
    """One parameter (or one expert of it) found without a gradient.

    Args:
        parameter: its name.
        module: its module's path.
        module_type: its module's class.
        op_class: its module's operator class.
        expert: the expert's index in a fused MoE weight, else ``None``.
        what: ``"no gradient"`` or ``"all-zero gradient"``.
        since: the global step its run of gradient-free steps began.
        frozen: ``requires_grad`` is off: frozen on purpose, or by mistake.
    """

    parameter: str
    module: str
    module_type: str
    op_class: str
    expert: int | None
    what: str
    since: int
    frozen: bool

    def row(self) -> list[Any]:
        """Its row in the table."""
        return [self.parameter + ("" if self.expert is None else f"[{self.expert}]"), self.module, self.module_type,
                self.op_class, "-" if self.expert is None else self.expert, self.what, self.since,
                "yes" if self.frozen else "no"]


#: the table's header
COLUMNS = ["parameter", "module", "module type", "op class", "expert", "what", "since step", "requires_grad off"]


def _experts(name: str, param: Tensor, owner: nn.Module | None) -> bool:
    return param.dim() == 3 and not isinstance(owner, ConvNd)


class DeadWatch:
    """Counts, per stepped parameter and per expert, the checked steps in a row without a gradient.

    Args:
        after: checked steps in a row that make a parameter (or expert) dead.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> watch = DeadWatch(after=2)
        >>> watch.start(model)
        >>> model.weight.grad, model.bias.grad = torch.ones(2, 2), torch.zeros(2)
        >>> norms = torch.stack([p.grad.norm() for p in model.parameters()])
        >>> [watch.flag(list(model.parameters()), norms, step=s).item() for s in (0, 1)]
        [0.0, 1.0]
        >>> [d.parameter for d in watch.newly_dead(model)]
        ['bias']
    """

    def __init__(self, after: int) -> None:
        self.after = after
        self.found: list[Dead] = []
        self._reported: set[tuple[str, int | None]] = set()
        self._names: tuple[str, ...] = ()
        self._counts: Tensor | None = None  # parameters with a gradient, in the check's order
        self._experts: dict[str, Tensor] = {}  # fused expert weights: a count per expert
        self._missing: dict[str, int] = {}  # parameters without a gradient (known on the host)
        self._since: dict[str, int] = {}
        self._step = 0
        self._param_names: dict[int, str] = {}
        self._fused: set[str] = set()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: what was named, and every count, so a resumed run continues them."""
        return {"found": [dataclasses.asdict(d) for d in self.found],
                "reported": sorted([name, expert] for name, expert in self._reported),
                "missing": dict(self._missing), "since": dict(self._since), "step": self._step,
                "names": list(self._names), "counts": None if self._counts is None else self._counts.tolist(),
                "experts": {name: counts.tolist() for name, counts in self._experts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (the counts come back on the CPU and move to the gradients' device)."""
        self.found = [Dead(**d) for d in state.get("found", [])]
        self._reported = {(name, expert) for name, expert in state.get("reported", [])}
        self._missing, self._since = dict(state.get("missing", {})), dict(state.get("since", {}))
        self._step = int(state.get("step", 0))
        self._names = tuple(state.get("names", ()))
        counts = state.get("counts")
        self._counts = None if counts is None else torch.tensor(counts, dtype=torch.float32)
        self._experts = {name: torch.tensor(c, dtype=torch.float32) for name, c in state.get("experts", {}).items()}

    def start(self, model: nn.Module) -> None:
        """At a fit's setup: the parameters' names, and which are fused expert weights."""
        owners = dict(model.named_modules())
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._fused = {n for n, p in model.named_parameters() if _experts(n, p, owners.get(n.rpartition(".")[0]))}

    def flag(self, params: list[Tensor], norms: Tensor | None, step: int) -> Tensor:
        """Count this checked step; a 1-element flag on the device: some count reached ``after`` (no sync).

        Args:
            params: the stepped parameters.
            norms: the check's per-gradient norms, one per parameter of ``params`` with a (dense, non-empty)
                gradient, in that order.
            step: the global step.
        """
        self._step = step
        named = [(self._param_names.get(id(p), "?"), p) for p in params]
        with_grad = [(n, p) for n, p in named if p.grad is not None and not local(p.grad).is_sparse and
                     local(p.grad).numel()]
        for name, param in named:
            if param.grad is None:
                self._missing[name] = self._missing.get(name, 0) + 1
                self._since.setdefault(name, step)
            else:
                self._missing.pop(name, None)
                self._since.pop(name, None)
        names = tuple(n for n, _ in with_grad)
        device = norms.device if norms is not None else torch.device("cpu")
        if norms is None or names != self._names or self._counts is None:
            self._names, self._counts = names, torch.zeros(len(names), device=device)
        elif self._counts.device != device:  # restored from a checkpoint
            self._counts = self._counts.to(device)
        if norms is not None:
            self._counts.add_(1).mul_(norms == 0)
        # flagged at the step a count reaches ``after``, not after: the counts are read once per parameter that dies
        tops = [(self._counts == self.after).any()] if len(names) else []
        for name, param in with_grad:
            if name in self._fused:
                zero = local(param.grad).flatten(1).abs().amax(dim=1) == 0
                counts = self._experts.get(name)
                if counts is None or counts.shape != zero.shape:
                    counts = self._experts[name] = torch.zeros(zero.shape, device=zero.device)
                elif counts.device != zero.device:  # restored from a checkpoint
                    counts = self._experts[name] = counts.to(zero.device)
                counts.add_(1).mul_(zero)
                tops.append((counts == self.after).any())
        host = any(c == self.after for c in self._missing.values())
        top = torch.stack(tops).any() if tops else torch.zeros((), dtype=torch.bool, device=device)
        return (top | host).float().reshape(1)

    def newly_dead(self, model: nn.Module) -> list[Dead]:
        """The parameters and experts whose count reached ``after`` and that were not named before (reads the counts).

        Args:
            model: the root module.
        """
        owners = dict(model.named_modules())
        params = dict(model.named_parameters())
        new: list[Dead] = []
        for name, expert, what, since in self._reached():
            if (name, expert) in self._reported or (expert is not None and (name, None) in self._reported):
                continue
            self._reported.add((name, expert))
            path = name.rpartition(".")[0]
            owner, param = owners.get(path), params.get(name)
            new.append(Dead(name, path, type(owner).__name__ if owner is not None else "-",
                            classify_module(owner) if owner is not None else "other", expert, what, since,
                            param is not None and not param.requires_grad))
        self.found.extend(new)
        return new

    def name_new(self, model: nn.Module) -> list[Dead]:
        """Name, once, what newly reached ``after``: a warning (those not frozen on purpose); returns them.

        Args:
            model: the root module.
        """
        new = self.newly_dead(model)
        warning = self.warning(new) if new else None
        if warning is not None:
            warn_once(warning, stacklevel=4)
        return new

    def warning(self, new: list[Dead]) -> str | None:
        """The warning that names ``new`` (those not frozen on purpose), or ``None`` when every one is frozen."""
        live = [d for d in new if not d.frozen]
        if not live:
            return None
        return (f"NaNDetector: no gradient over {self.after} checked steps in a row for " + "; ".join(
            f"{d.row()[0]} ({d.module_type} {d.module!r}: {d.what})" for d in live[:8]) + (
            f" and {len(live) - 8} more" if len(live) > 8 else "") + ": a layer frozen by mistake, a branch never"
            " taken, an expert no token is routed to, or a gate trained through topk indices")

    def summary_line(self) -> str:
        """The run summary's line: what was found without a gradient."""
        return (f"  no gradient over {self.after} checked steps: {len(self.found)} parameter(s) or expert(s)"
                + "".join(f"; {d.row()[0]} ({d.what}{', requires_grad off' if d.frozen else ''})"
                          for d in self.found[:6]) + ("; ..." if len(self.found) > 6 else ""))

    def _reached(self) -> Iterator[tuple[str, int | None, str, int]]:
        """``(parameter, expert, what, since)`` for every count at ``after`` or past it (a sync: the slow path)."""
        for name, count in self._missing.items():
            if count >= self.after:
                yield name, None, "no gradient", self._since.get(name, self._step - count + 1)
        if self._counts is not None:
            for name, count in zip(self._names, self._counts.tolist(), strict=True):
                if count >= self.after and name not in self._experts:
                    yield name, None, "all-zero gradient", self._step - int(count) + 1
        for name, counts in self._experts.items():
            for expert, count in enumerate(counts.tolist()):
                if count >= self.after:
                    yield name, expert, "all-zero gradient", self._step - int(count) + 1


def write_dead(writer: LogWriter, found: list[Dead], step: int) -> None:
    """``opkit/nan/dead_parameters``: every parameter and expert named so far.

    Args:
        writer: the detector's writer.
        found: what the dead-parameter watch has named.
        step: the global step.
    """
    writer.text("opkit/nan/dead_parameters", markdown_table(COLUMNS, [d.row() for d in found]), step)
    writer.flush()
