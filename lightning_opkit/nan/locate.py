"""Find where a non-finite value first appears, by running a step again with per-module hooks attached.

This is the slow path of :class:`~lightning_opkit.NaNDetector`: it runs only after the cheap per-step check saw a
non-finite loss or gradient, so it may sync freely. Everything here works on a plain ``nn.Module`` and a callable
that computes the loss, and is tested without a Trainer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_opkit.core.dtypes import full_name
from lightning_opkit.core.fsdp import reshard
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.ranks import local, local_floats
from lightning_opkit.core.replay import REPLAYING, preserved, replay_backward, set_rng_state
from lightning_opkit.core.warn import warn_once
from lightning_opkit.nan.report import Origin
from lightning_opkit.opclass import classify_function, classify_module


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
