"""How one step runs under a PrecisionPolicy, Trainer-free: its mode, module overrides, plain autocast, census.

A step runs in one of three ways: under the policy's function mode (a table autocast cannot express, a module
override, a census step, a NaN cause replay's fp32 region); under plain ``torch.autocast`` (``rules="auto"`` chose
it, or the table is exactly what autocast does: GEMM classes in one 16-bit dtype, every other class ``keep``); or as
written (fp32 decided everywhere on an fp32 model). Only the first pays the mode's Python cost on every op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_opkit.core.patch import Patches
from lightning_opkit.precision.census import Census
from lightning_opkit.precision.dtypes import DTYPES, GOVERNED
from lightning_opkit.precision.function_mode import ModeState, PolicyMode
from lightning_opkit.precision.oplog import OpLog

__all__ = ["ASIDE", "AUTOCAST_LOWERS", "STEP_METHODS", "StepGovernor", "autocast_expresses"]

#: a LightningModule's step methods, each run as the policy says
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")

ASIDE = "nothing lowered on this fp32 model: the policy stands aside (the model runs as written, no census)"
#: the op classes autocast lowers to its 16-bit dtype: their ops are on its lower-precision list on CPU and CUDA, or
#: are composites of ops on it (``einsum``, ``tensordot``)
AUTOCAST_LOWERS = ("matmul", "conv", "attention")
#: modules whose GEMMs autocast treats otherwise than the mode's class rule (it lowers some RNN kernels and no
#: ``bilinear``): a table is not expressed as autocast on a model holding one
_UNLIKE_AUTOCAST = (torch.nn.RNNBase, torch.nn.Bilinear)


def autocast_expresses(table: dict[str, str]) -> str | None:
    """The 16-bit dtype whose plain ``torch.autocast`` runs ``table`` as the mode would, else ``None``.

    That is ``matmul``, ``conv`` and ``attention`` in one 16-bit dtype and every other class ``keep`` (left to
    autocast, which keeps some, losses on CPU and softmax/norms on CUDA, in fp32). A GEMM class missing from ``table``
    (``rules="auto"`` did not see the model run it) matches any.

    Args:
        table: op class -> dtype name.

    Example:
        >>> autocast_expresses({"matmul": "bf16", "norm": "keep"})
        'bf16'
        >>> autocast_expresses({"matmul": "bf16", "norm": "fp32"}) is None  # autocast cannot raise a norm to fp32
        True
    """
    lowered = {table[c] for c in AUTOCAST_LOWERS if c in table}  # a class not given (not seen to run) matches
    if len(lowered) != 1 or not lowered <= {"bf16", "fp16"}:
        return None
    if any(table.get(c, "keep") != "keep" for c in GOVERNED if c not in AUTOCAST_LOWERS):
        return None
    return lowered.pop()


class StepGovernor:
    """Wraps step methods so each runs as the policy says, and hands the census and op log of a step to its owner.

    Args:
        table: op class -> dtype name, to start with.

    Example:
        >>> governor = StepGovernor({"matmul": "bf16"})
        >>> step = governor.wrap(lambda x: (x @ x).dtype, is_training=True)
        >>> step(torch.ones(2, 2))
        torch.bfloat16
    """

    def __init__(self, table: dict[str, str]) -> None:
        self.state = ModeState(table)
        self.mode = PolicyMode(self.state)
        #: the step runs without the mode: fp32 everywhere on an fp32 model, or plain autocast
        self.passthrough = False
        #: plain autocast in this dtype name (``rules="auto"`` chose it), on ``autocast_device``
        self.autocast: str | None = None
        #: the table in force is what autocast in this dtype name does: autocast runs it (see :meth:`express`)
        self.expressed: str | None = None
        self.autocast_device = "cpu"
        #: the next training step is a census step
        self.census_step = False
        #: set to record the next training step's ops (the speed check); moved to ``recorded`` when it ran
        self.speed_log: OpLog | None = None
        self.recorded: OpLog | None = None
        #: the census of the last census step, until its owner logs it
        self.census_done: Census | None = None
        self._forced: list[torch.dtype | None] = []  # a dtype for the whole step (running_in(None, ...))
        self._overriding = 0  # running_in() contexts open: the mode must run
        #: modules pinned to a dtype at run time (a NaN repair): the mode must run
        self.pinned = False

    def express(self, table: dict[str, str], model: torch.nn.Module, overrides: bool) -> None:
        """From the next step, run ``table`` as plain autocast where autocast does exactly that, without the mode.

        Args:
            table: the table in force.
            model: the model, on its device (one holding an RNN or ``nn.Bilinear`` keeps the mode).
            overrides: module overrides or float8 GEMMs are held (they need the mode).
        """
        expressed = None if overrides else autocast_expresses(table)
        if expressed is not None and any(isinstance(m, _UNLIKE_AUTOCAST) for m in model.modules()):
            expressed = None
        self.expressed = expressed
        self.autocast_device = next(model.parameters(), torch.empty(0)).device.type

    def settle(self, table: dict[str, str], decided: dict[str, str], model: torch.nn.Module, overrides: bool,
               fp8: bool = False) -> None:
        """How steps run from now on under a decided ``table``: as written, as plain autocast, or under the mode.

        Args:
            table: the table in force, every class.
            decided: the classes decided (those the model was seen to run) and their dtypes.
            model: the model, on its device.
            overrides: module overrides are held (they need the mode).
            fp8: float8 GEMMs run (they are not autocast's either).
        """
        # Nothing worth lowering on an fp32 model without autocast: the model runs as written, without the mode's
        # per-op cost (~2% of a step on the example) and without a census. NaN cause replays still enter it.
        self.passthrough = not overrides and (self.autocast is not None or (
            all(table[c] == "fp32" for c in GOVERNED)
            and all(t.dtype == torch.float32 for t in (*model.parameters(), *model.buffers())
                    if t.is_floating_point())))
        self.express(decided, model, overrides or fp8 or self.autocast is not None)

    def aside(self) -> str:
        """Why the mode stands aside on most steps, for the summary: empty where it runs."""
        if self.expressed is not None and self.autocast is None:
            return (f"the table is what torch.autocast in {self.expressed} does: autocast runs it, the mode only on"
                    " census steps")
        return ASIDE if self.passthrough else ""

    def census(self) -> Any:
        """The census of the census step running now, else ``None``."""
        return self.state.census

    def set_table(self, table: dict[str, str]) -> None:
        """Run ``table`` from the next op on."""
        self.state.set_table(table)

    def clear(self) -> None:
        """Forget the current step's module stack and anything recorded (a detach)."""
        self.state.module_stack.clear()
        self.state.census = self.census_done = None
        self.speed_log = self.recorded = None

    def hold_override(self, patches: Patches, module: torch.nn.Module, dtype: torch.dtype | None) -> None:
        """Every op inside ``module`` runs in ``dtype`` (``None``: as its class rule says), while ``patches`` hold."""

        def push(module: torch.nn.Module, args: Any) -> None:
            self.state.module_stack.append(dtype)

        def pop(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.state.module_stack:
                self.state.module_stack.pop()

        patches.hold(module.register_forward_pre_hook(push))
        patches.hold(module.register_forward_hook(pop, always_call=True))

    @contextlib.contextmanager
    def running_in(self, module: torch.nn.Module | None, dtype: str) -> Iterator[None]:
        """Inside, every op in ``module`` (``None``: in the whole step) runs in ``dtype``."""
        patches = Patches()
        self._overriding += 1
        if module is None:
            self._forced.append(DTYPES[dtype])
        else:
            self.hold_override(patches, module, DTYPES[dtype])  # after the module overrides: wins
        try:
            yield
        finally:
            patches.restore()
            self._overriding -= 1
            if module is None:
                self._forced.pop()

    def runs_mode(self, is_training: bool) -> bool:
        """Whether this step runs under the policy's mode (else the model runs as written, or under autocast)."""
        if self._overriding or self.pinned or (is_training and self.speed_log is not None):
            return True  # a NaN cause replay's fp32 region, a pinned module, the speed check's recorded step
        if self.expressed is not None or (self.autocast is not None and self.passthrough):
            return is_training and self.census_step  # census steps count what autocast ran
        if not self.passthrough:
            return True  # a table to apply, or module overrides (on top of plain autocast too)
        return bool(self.state.autocast_devices)  # fp32 decided, but the Trainer's autocast would lower ops

    def govern_steps(self, patches: Patches, model: Any) -> dict[str, Callable[..., Any]]:
        """Run ``model``'s step methods as the policy says, through ``patches``; their originals, by name.

        Lightning runs a validation or test loop only if the user overrode its step: a wrapper must not look like an
        override of a method the user never wrote (``predict_step``'s default does run, so it is governed).

        Args:
            patches: the policy's patches (undone at teardown).
            model: the LightningModule.
        """
        originals = {}
        for method in STEP_METHODS:
            if method in ("validation_step", "test_step") and not is_overridden(method, model):
                continue
            original = originals[method] = getattr(model, method)
            patches.set(model, method, self.wrap(original, method == "training_step"))
        return originals

    def wrap(self, step: Callable[..., Any], is_training: bool) -> Callable[..., Any]:
        """``step`` (a LightningModule's step method), run as the policy says."""

        def run_step(*args: Any, **kwargs: Any) -> Any:
            device, dtype = self.autocast_device, self.autocast or self.expressed
            if dtype is not None and not torch.is_autocast_enabled(device):
                # plain autocast (auto chose it, or it is the table): the step runs as under precision="bf16-mixed"
                with torch.autocast(device, dtype=DTYPES[dtype]):
                    return self._governed(step, is_training, args, kwargs)
            return self._governed(step, is_training, args, kwargs)

        return run_step

    def _governed(self, step: Callable[..., Any], is_training: bool, args: tuple, kwargs: dict) -> Any:
        state = self.state
        state.module_stack.clear()
        state.module_stack.extend(self._forced)
        state.autocast_devices = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
        if not self.runs_mode(is_training):
            self.census_step = False  # the policy runs nothing: nothing to count either
            return step(*args, **kwargs)
        log = census = None
        if is_training and self.speed_log is not None:
            log, self.speed_log = self.speed_log, None  # this step's own run only, not a NaN replay of it
        if is_training and self.census_step:
            # Only the batch's own step is counted, not a NaNDetector replay of it.
            self.census_step = False
            census = state.census = Census()
        # A census step runs eagerly even where TorchCompile compiled the model, so every op is counted; so does the
        # speed check's recording step, so its log sees each op as the model called it. Only those steps pay.
        eager = (torch.compiler.set_stance("force_eager") if census is not None or log is not None
                 else contextlib.nullcontext())
        try:
            with eager, self.mode, log or contextlib.nullcontext():
                return step(*args, **kwargs)
        finally:
            if census is not None:
                state.census, self.census_done = None, census
            if log is not None:
                self.recorded = log
