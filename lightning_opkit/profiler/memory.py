"""The memory view, Trainer-free: what a step holds, by kind, by module and by operator class, and the lever.

One step of a window is probed: the bytes autograd saves for backward (:class:`~lightning_opkit.core.saved.SavedBytes`,
each storage once, attributed to the module running and the op class that produced it), each block's forward time
(what checkpointing it would cost again in backward), and, before the optimizer steps, the exact bytes of the
parameters, their gradients and the optimizer's state. The peak is the allocator's on CUDA; on a CPU, with the
window's ``profile_memory``, the peak of allocations over the recorded steps above what was held when they began.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_opkit.core.ranks import local
from lightning_opkit.core.saved import SavedBytes, plain_tensors
from lightning_opkit.core.select import inside
from lightning_opkit.core.timing import StepClock

__all__ = ["MemoryProbe", "MemoryReport", "tensor_bytes"]

_MB = 2**20


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors (local shards of DTensors), each storage once.

    Example:
        >>> w = torch.zeros(4, 4)
        >>> tensor_bytes([w, w.t(), torch.zeros(2, dtype=torch.half)])
        68
    """
    seen: set[Any] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            continue
        for t in plain_tensors(local(tensor)):
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


@dataclass
class MemoryReport:
    """One window's memory: bytes by kind, activations by module and op class, blocks' forward times.

    Args:
        parameters: bytes of the parameters.
        gradients: bytes of their gradients, before the optimizer step.
        optimizer: bytes of the optimizer's state.
        activations: bytes autograd saved for backward in the probed step.
        peak: the peak (see the module's notes), ``None`` where not measured.
        activations_by_module: bytes saved while each module ran, its submodules included.
        activations_by_class: bytes saved, by the op class that produced them.
        by_block_class: per block, bytes by op class (the picture's stacked bars).
        block_forward_s: each block's forward time in the probed step.
        step: the global step probed.
        checkpointed: blocks an attached ActivationCheckpointing checkpoints (the run's facts): the lever says so
            rather than advise what is done.
        eager: the probed step ran its compiled regions eagerly (a region holds the blocks: the probe's hooks inside
            it would have recompiled it), so these are eager figures.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    peak: int | None = None
    activations_by_module: dict[str, int] = field(default_factory=dict)
    activations_by_class: dict[str, int] = field(default_factory=dict)
    by_block_class: dict[str, dict[str, int]] = field(default_factory=dict)
    block_forward_s: dict[str, float] = field(default_factory=dict)
    step: int = -1
    checkpointed: dict[str, list[str]] = field(default_factory=dict)
    eager: bool = False

    def scalars(self) -> dict[str, float | None]:
        """``opkit/memory/...`` scalars, in MB."""
        return {"parameters_mb": self.parameters / _MB, "gradients_mb": self.gradients / _MB,
                "optimizer_mb": self.optimizer / _MB, "activations_mb": self.activations / _MB,
                "peak_mb": None if self.peak is None else self.peak / _MB}

    def module_rows(self, top: int) -> list[list[Any]]:
        """The ``top`` modules holding the most activation bytes (their submodules included), blocks first."""
        blocks = [(p, self.activations_by_module.get(p, 0)) for p in self.by_block_class]
        others = sorted(((p, n) for p, n in self.activations_by_module.items() if p and p not in self.by_block_class),
                        key=lambda pn: -pn[1])
        rows = []
        for path, n in [*blocks, *others][: max(top, len(blocks))]:
            share = n / self.activations if self.activations else 0.0
            ms = self.block_forward_s.get(path)
            rows.append([path, f"{n / _MB:.2f}", f"{share:.1%}", "-" if ms is None else f"{1e3 * ms:.2f}"])
        return rows

    def class_rows(self) -> list[list[Any]]:
        """Activation bytes by the op class that produced them, largest first."""
        return [[c, f"{n / _MB:.2f}", f"{n / self.activations:.1%}" if self.activations else "-"]
                for c, n in sorted(self.activations_by_class.items(), key=lambda cn: -cn[1])]

    def lever(self) -> str | None:
        """Which blocks to checkpoint, the bytes it frees (measured) and the recompute it costs (their forwards)."""
        if not self.by_block_class or not self.activations:
            return None
        done = [b for b in self.by_block_class if b in self.checkpointed]
        if done:
            kept = sum(self.activations_by_module.get(b, 0) for b in done)
            return (f"{len(done)} of {len(self.by_block_class)} blocks are checkpointed already"
                    f" (ActivationCheckpointing): they hold {kept / _MB:.2f} MB of the {self.activations / _MB:.2f} MB"
                    " saved for backward")
        held = sum(self.activations_by_module.get(b, 0) for b in self.by_block_class)
        seconds = sum(self.block_forward_s.get(b, 0.0) for b in self.by_block_class)
        if held < 0.2 * self.activations:
            return (f"the blocks hold {held / _MB:.1f} of {self.activations / _MB:.1f} MB of saved activations:"
                    " checkpointing them would free little")
        names = list(self.by_block_class)
        return (f"ActivationCheckpointing(modules={names if len(names) <= 4 else 'auto'!r}) would free up to"
                f" {held / _MB:.1f} MB of the {self.activations / _MB:.1f} MB saved for backward (each block keeps"
                f" only its input), at about {1e3 * seconds:.1f} ms more per step (their forwards, run again in"
                f" backward); save=['matmul', 'attention'] frees less and recomputes less")


class MemoryProbe:
    """Probes one step: saved activations (attributed), block forward times, then the state's bytes.

    A compiled region (TorchCompile's) that holds a block would trace the probe's hooks into its graph and recompile
    each window (dynamo guards on the hooks, and on the module path they read): the probed step then runs the compiled
    regions eagerly, and the report says its figures are eager ones.

    Args:
        model: the LightningModule.
        blocks: the repeated blocks' paths (the view's rows, the lever's candidates).
        compiled: the compiled regions' paths (the run's facts).

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        >>> probe = MemoryProbe(net, blocks=["1"])
        >>> probe.begin(step=0)
        >>> loss = net(torch.ones(4, 8, requires_grad=True)).sum()
        >>> probe.forward_done()
        >>> loss.backward()
        >>> probe.step_done()
        >>> report = probe.report([])
        >>> report.parameters, report.gradients, report.activations_by_module["1"], report.step
        (576, 576, 256, 0)
    """

    def __init__(self, model: nn.Module, blocks: list[str], compiled: Sequence[str] = ()) -> None:
        self.model, self.blocks = model, blocks
        #: a compiled region below the LightningModule holds a block: the probed step runs eagerly (not yet where the
        #: LightningModule's own forward is the region: its stance outlived the fit in the matrix, see the closing note)
        self.eager = "" in compiled or any(inside(b, compiled) for b in blocks)
        self._stance: Any = None
        self.saved = SavedBytes(model)
        self._counting: Any = None
        self._clocks: dict[str, StepClock] = {}
        self._hooks: list[Any] = []
        self._gradients = -1
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.step = -1

    def begin(self, step: int) -> None:
        """The probed step starts: count what is saved, time each block's forward (call :meth:`step_done` after it).

        Args:
            step: its global step (the report's, whatever step the window ends at).
        """
        self.step = step
        if self.eager:
            self._stance = torch.compiler.set_stance("force_eager")
            self._stance.__enter__()
        self._counting = self.saved.counting(attribute=True)
        self._counting.__enter__()
        for path in self.blocks:
            clock = self._clocks[path] = StepClock()
            block = self.model.get_submodule(path)
            self._hooks.append(block.register_forward_pre_hook(
                lambda m, a, clock=clock: clock.start(self._device)))
            self._hooks.append(block.register_forward_hook(
                lambda m, a, o, clock=clock: clock.stop(keep=True), always_call=True))

    def forward_done(self) -> None:
        """Its forward is done (before backward): stop counting and timing."""
        if self._counting is not None:
            counting, self._counting = self._counting, None
            counting.__exit__(None, None, None)
        while self._hooks:
            self._hooks.pop().remove()

    def step_done(self) -> None:
        """The probed step is over (its batch ended): its compiled regions compile again.

        The stance is left here, not when the forward is done: what the step itself enters (the policy's census step
        forces eager around the whole training step) must close first. ``set_stance`` restores the stance it found
        when entered, so a stance left out of order puts back a forced one that outlives the fit.
        """
        if self._stance is not None:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)

    @property
    def gradients_unread(self) -> bool:
        """Whether the gradients' bytes are still to be read (the probed step's first optimizer step)."""
        return self._gradients < 0

    def gradients_ready(self) -> None:
        """Before the optimizer step: the gradients' bytes are read now (zero_grad may free them after)."""
        self._gradients = tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def report(self, optimizers: list[torch.optim.Optimizer], peak: int | None = None,
               checkpointed: dict[str, list[str]] | None = None) -> MemoryReport:
        """What was probed, and the bytes of the parameters and the optimizers' state now."""
        self.forward_done()
        if self._gradients < 0:
            self.gradients_ready()
        state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, Tensor)]
        by_class: dict[str, int] = {}
        by_block: dict[str, dict[str, int]] = {b: {} for b in self.blocks}
        for (path, cls), n in self.saved.cells.items():
            by_class[cls] = by_class.get(cls, 0) + n
            block = next((b for b in self.blocks if path == b or path.startswith(b + ".")), None)
            if block is not None:
                by_block[block][cls] = by_block[block].get(cls, 0) + n
        times = {p: c.seconds(wait=True)[-1] for p, c in self._clocks.items() if c.seconds(wait=True)}
        return MemoryReport(tensor_bytes(self.model.parameters()), self._gradients, tensor_bytes(state),
                            self.saved.activations, peak, dict(self.saved.by_module), by_class, by_block, times,
                            self.step, dict(checkpointed or {}), self.eager)

    def close(self) -> None:
        """Stop whatever is still open (an exception mid-step)."""
        with contextlib.suppress(Exception):
            self.forward_done()
        with contextlib.suppress(Exception):
            self.step_done()

