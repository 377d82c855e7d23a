"""An observer that shares no code with opkit: what actually ran, seen at torch's dispatcher and on the file system.

The kit's reports (the census, the policy table, the float8 lines, the run summary's log locations) are compared with
what this observer saw, never with the kit's own account of itself:

- :class:`GemmObserver`: every GEMM kernel (``mm``, ``addmm``, ``bmm``, ``baddbmm``, float8's ``_scaled_mm``,
  ``convolution``) that ran in a module's forward, with the dtype of its inputs, the innermost module whose forward was
  running (global module hooks: the model itself gets none), and the training step (set by :class:`StepMark`).
  Dynamo compiles nothing while a dispatch mode is active, so a compiled case is not observed this way.
- :func:`event_dirs`, :func:`trace_files`: the directories holding TensorBoard event files, and the traces, as the file
  system has them.
"""

from __future__ import annotations

import os
import re

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: the kernels that do a GEMM's work, by the op class the kit's taxonomy gives them
GEMM_KERNELS = {
    aten.mm.default: "matmul", aten.addmm.default: "matmul", aten.bmm.default: "matmul",
    aten.baddbmm.default: "matmul", aten._scaled_mm.default: "matmul", aten.convolution.default: "conv",
}
#: dtype names as the kit's reports spell them
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
         torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}


class GemmObserver(TorchDispatchMode):
    """Records ``(step, module path, op class, dtype)`` for each GEMM kernel run inside a module's forward.

    Args:
        model: the model whose module paths name the records (paths as ``model.named_modules()`` gives them).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.modules = list(model.named_modules())
        self.names = {id(m): n for n, m in self.modules}
        self.stack: list[str] = []
        self.step = -1
        self.records: list[tuple[int, str, str, str]] = []
        self._handles: list = []

    def __enter__(self):
        hooks = nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._push),
                         hooks.register_module_forward_hook(self._pop)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return super().__exit__(*exc)

    def _push(self, module, args):
        self.stack.append(self.names.get(id(module), "?"))

    def _pop(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = GEMM_KERNELS.get(func)
        in_backward = torch._C._current_graph_task_id() != -1
        if kind is not None and self.stack and not in_backward:
            self.records.append((self.step, self.stack[-1], kind, _dtype(args[0])))
        return func(*args, **(kwargs or {}))

    def at(self, step: int) -> list[tuple[str, str, str]]:
        """``(module, class, dtype)`` of each GEMM kernel of ``step``'s forward passes."""
        return [r[1:] for r in self.records if r[0] == step]

    def dtypes_of(self, module: str) -> set[str]:
        """The dtypes the GEMM kernels run directly in ``module``'s forward took, over the whole fit."""
        return {r[3] for r in self.records if r[1] == module}


def _dtype(tensor: torch.Tensor) -> str:
    """The dtype a kernel's input holds its values in: a float8 wrapper (torchao's) reports its high-precision dtype
    as ``.dtype`` and keeps the float8 data inside."""
    inner = getattr(tensor, "_data", None)
    dtype = inner.dtype if isinstance(inner, torch.Tensor) else tensor.dtype
    return NAMES.get(dtype, str(dtype))


class StepMark(pl.Callback):
    """Tells a :class:`GemmObserver` which training step runs."""

    def __init__(self, observer: GemmObserver) -> None:
        self.observer = observer

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.observer.step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.observer.step = -1


def event_dirs(root) -> list[str]:
    """Every directory under ``root`` holding TensorBoard event files."""
    return sorted({d for d, _, fs in os.walk(root) for f in fs if f.startswith("events.out.tfevents.")})


def trace_files(root) -> list[str]:
    """Every profiler trace under ``root``."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if ".pt.trace.json" in f)


class RangeObserver:
    """Records the named ranges pushed and popped through torch's ITT and NVTX APIs, seen from ``sys.setprofile``.

    Every call into ``torch.profiler.itt.range_push``/``range_pop`` (and ``torch.cuda.nvtx``'s) on this thread is
    counted with its name, whoever makes it: nothing of opkit's is read.
    """

    def __init__(self) -> None:
        import torch.cuda.nvtx as nvtx
        import torch.profiler.itt as itt

        self._push = {itt.range_push.__code__, nvtx.range_push.__code__}
        self._pop = {itt.range_pop.__code__, nvtx.range_pop.__code__}
        self.events: list[tuple[str, str | None]] = []

    def _profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code in self._push:
                self.events.append(("push", frame.f_locals.get("msg")))
            elif code in self._pop:
                self.events.append(("pop", None))

    def __enter__(self):
        import sys

        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        import sys

        sys.setprofile(None)
        return False

    @property
    def names(self) -> list[str]:
        """The names pushed, in order."""
        return [name for kind, name in self.events if kind == "push"]

    def balanced(self) -> bool:
        """Every push popped, and never a pop with nothing open."""
        depth = 0
        for kind, _ in self.events:
            depth += 1 if kind == "push" else -1
            if depth < 0:
                return False
        return depth == 0


class DynamoRecompiles:
    """Dynamo's own recompile messages, from torch's ``recompiles`` log artifact, while inside.

    Nothing of opkit's is read: the messages are the ones ``TORCH_LOGS=recompiles`` prints.
    """

    def __init__(self) -> None:
        import logging

        self.messages: list[str] = []
        outer = self

        class _Keep(logging.Handler):
            def emit(self, record):
                outer.messages.append(record.getMessage())

        self._handler = _Keep()
        self._logger = logging.getLogger("torch._dynamo.guards.__recompiles")

    def __enter__(self):
        self._logger.addHandler(self._handler)
        torch._logging.set_logs(recompiles=True)
        return self

    def __exit__(self, *exc):
        torch._logging.set_logs()
        self._logger.removeHandler(self._handler)
        return False

    def on_hooks(self) -> list[str]:
        """The recompiles a module hook caused (a guard on a module's or the global hook dicts failed)."""

        def ours(line: str) -> bool:  # a failed guard (``- 3/1: ...``) on hooks, not the source line echoed after it
            guard = re.match(r"\s*- \d+/\d+: (.*?)(  #|$)", line)
            return guard is not None and ("_forward_hooks" in guard.group(1) or "_forward_pre_hooks" in guard.group(1))

        return [m for m in self.messages if any(ours(line) for line in m.splitlines())]
