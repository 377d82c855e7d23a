"""Named ranges for Nsight Systems (NVTX) and VTune (ITT): each module's forward under its path and op class.

``nsys profile -t cuda,nvtx`` and ``vtune -collect hotspots -knob enable-user-tasks=true`` group time by the ranges a
program pushes; without them, an opkit run shows anonymous kernels. :class:`Ranges` pushes one range per training
step (``opkit step <n>``) and one per module forward, named as TensorBoard names it: ``<module path> [<op class>]``
(``blocks.0.attn.qkv [matmul]``; the root goes by its class name; a module of a library opkit cannot classify before
it runs is ``[other]``; Hugging Face's ``Conv1D``, a transposed Linear, is ``[matmul]``). NVTX where the model runs on
CUDA, ITT on a CPU (both in torch's own builds; ITT needs no VTune to be called). Every push is popped on every path:
a module's forward hook runs even when the forward raises (``always_call``), and :meth:`Ranges.close` pops whatever
an exception left open.

A module inside a compiled region (TorchCompile's) gets no range of its own: its region's covers it. A hook there would
be traced into the region's graph (the push a graph break) and, added and removed with each window, fail dynamo's guard
on the module's hooks every time: a recompile per window, until the region reaches dynamo's limit and runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_opkit.core.patch import Patches
from lightning_opkit.core.select import inside
from lightning_opkit.core.warn import warn_once
from lightning_opkit.opclass import classify_module

__all__ = ["RANGE_KINDS", "Ranges", "range_functions", "ranges_for"]

#: ``ProfilerWindows(ranges=...)``: none, during each window, or on every training step
RANGE_KINDS = ("off", "windows", "steps")


def range_functions(device: torch.device | str) -> tuple[Callable[[str], Any], Callable[[], Any]] | None:
    """``(push, pop)`` of the range API the tools read for ``device``: NVTX on CUDA, ITT on a CPU; else ``None``.

    Args:
        device: where the model runs.

    Example:
        >>> push, pop = range_functions("cpu")
        >>> push.__module__, pop.__name__
        ('torch.profiler.itt', 'range_pop')
    """
    kind = torch.device(device).type
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    if kind == "cpu" and torch.profiler.itt.is_available():
        return torch.profiler.itt.range_push, torch.profiler.itt.range_pop
    return None


class Ranges:
    """Pushes and pops the named ranges of a model's forwards and of training steps, balanced on every path.

    Args:
        push: the range API's push (:func:`range_functions`).
        pop: its pop.

    Example:
        >>> ranges = Ranges(*range_functions("cpu"))
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> ranges.attach(model)
        >>> ranges.begin_step(0); _ = model(torch.ones(1, 2)); ranges.end_step()
        >>> ranges.pushed, ranges.depth
        (3, 0)
        >>> ranges.detach(); len(model[0]._forward_hooks)
        0
    """

    def __init__(self, push: Callable[[str], Any], pop: Callable[[], Any]) -> None:
        self._push, self._pop = push, pop
        self._patches = Patches()
        #: ranges open now
        self.depth = 0
        #: ranges pushed since construction
        self.pushed = 0
        self._step_open = False

    @property
    def attached(self) -> bool:
        """Whether the model's forwards push ranges now."""
        return bool(self._patches)

    def attach(self, model: nn.Module, compiled: Sequence[str] = ()) -> None:
        """From now on every module forward of ``model`` runs inside its range, until :meth:`detach`.

        Args:
            model: the root module.
            compiled: paths of compiled regions: the modules inside them get no range (their region's covers them).
        """
        if self.attached:
            return
        for path, module in model.named_modules():
            if inside(path, compiled):
                continue
            name = f"{path or type(module).__name__} [{classify_module(module)}]"
            self._patches.hold(module.register_forward_pre_hook(self._opener(name)))
            self._patches.hold(module.register_forward_hook(self._closer, always_call=True))

    def _opener(self, name: str) -> Callable[..., None]:
        def open_range(module: nn.Module, args: Any) -> None:
            self._open(name)

        return open_range

    def _closer(self, module: nn.Module, args: Any, output: Any) -> None:
        self._close_one()

    def _open(self, name: str) -> None:
        self._push(name)
        self.depth += 1
        self.pushed += 1

    def _close_one(self) -> None:
        if self.depth > int(self._step_open):  # a step's range is closed by end_step alone
            self._pop()
            self.depth -= 1

    def begin_step(self, step: int) -> None:
        """Open the range of training step ``step`` (closing one an interrupted step left open)."""
        self.close()
        self._open(f"opkit step {step}")
        self._step_open = True

    def end_step(self) -> None:
        """Close the step's range and anything inside it still open."""
        self.close()

    def close(self) -> None:
        """Pop every range still open (an exception, a step cut short)."""
        while self.depth:
            self._pop()
            self.depth -= 1
        self._step_open = False

    def detach(self) -> None:
        """Close what is open and remove every hook: the model as it was."""
        self.close()
        self._patches.restore()


def ranges_for(kind: str, device: torch.device | str) -> Ranges | None:
    """The ranges ``ProfilerWindows(ranges=kind)`` pushes on ``device``; ``None`` for ``"off"`` or no API (warned).

    Example:
        >>> ranges_for("off", "cpu") is None, type(ranges_for("steps", "cpu")).__name__
        (True, 'Ranges')
    """
    if kind == "off":
        return None
    functions = range_functions(device)
    if functions is None:
        warn_once(f"ProfilerWindows(ranges={kind!r}): torch has no range API for {device} (NVTX on CUDA, ITT on a"
                  " CPU): no ranges.", stacklevel=3)
        return None
    return Ranges(*functions)
