"""PrecisionPolicy: decide the dtype of each operator class (and each module), and show what actually ran."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, Literal, Optional, get_args

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from lightning_opkit._checks import check_int
from lightning_opkit._modes import _SUSPENDED
from lightning_opkit._modules import match_rule, resolve_modules
from lightning_opkit._patch import Patches
from lightning_opkit._summary import end_summary, start_summary
from lightning_opkit._tensorboard import TensorBoardWriter, markdown_table
from lightning_opkit.opclass import OP_CLASSES, function_info

__all__ = ["DEFAULT_RULES", "PrecisionPolicy"]

#: what the LightningCLI checks at parse time: a typo in a dtype or an op class fails there, naming the value
DtypeName = Literal["fp32", "bf16", "fp16", "keep"]
OpClassName = Literal["matmul", "conv", "attention", "norm", "softmax", "activation", "loss", "reduction", "pointwise",
                      "embedding", "rnn"]

DTYPES: dict[str, torch.dtype | None] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                                         "keep": None}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items() if v is not None}

#: GEMMs and GELU-like activations on Tensor Cores in bf16; variance, exponent and large-sum ops in fp32.
DEFAULT_RULES: dict[str, str] = {
    "matmul": "bf16", "conv": "bf16", "attention": "bf16", "activation": "bf16",
    "norm": "fp32", "softmax": "fp32", "loss": "fp32", "reduction": "fp32",
}
#: op classes the policy never casts: shape and bookkeeping ops, and casts and copies (casting their input first
#: would change what they produce).
_NEVER_CAST = ("other", "copy", "layout")
assert set(get_args(OpClassName)) == set(OP_CLASSES) - set(_NEVER_CAST) and set(get_args(DtypeName)) == set(DTYPES)
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_WARN_BITS = 4.0


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class _Census:
    """Per (class, dtype): calls and the running max |output|, kept on the device until the step ends."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, torch.dtype], int] = {}
        self.absmax: dict[tuple[str, torch.dtype], Tensor] = {}

    def record(self, cls: str, out: Any) -> None:
        tensors = out if isinstance(out, (list, tuple)) else (out,)
        for t in tensors:
            if isinstance(t, Tensor) and t.is_floating_point() and t.numel():
                key = (cls, t.dtype)
                self.calls[key] = self.calls.get(key, 0) + 1
                peak = t.detach().abs().amax().float()
                prev = self.absmax.get(key)
                self.absmax[key] = peak if prev is None else torch.maximum(prev, peak)

    def rows(self) -> list[tuple[str, str, int, float, float]]:
        """``(class, dtype, calls, max|out|, headroom bits)`` rows; one host sync for all of them."""
        keys = list(self.calls)
        if not keys:
            return []
        peaks = torch.stack([self.absmax[k] for k in keys]).tolist()
        rows = []
        for (cls, dtype), peak in zip(keys, peaks):
            fmax = torch.finfo(dtype).max
            headroom = math.inf if peak == 0 else (-math.inf if not math.isfinite(peak) else math.log2(fmax / peak))
            rows.append((cls, _DTYPE_NAMES.get(dtype, str(dtype)), self.calls[(cls, dtype)], peak, headroom))
        return rows


@torch._dynamo.assume_constant_result
def _traced_function_info(func: Callable[..., Any]) -> tuple[str, bool]:
    # Eagerly a plain cached lookup. Dynamo can neither trace str methods on a function's name nor guard on a
    # cache that grows (it would recompile each time), so it runs this once at trace time and keeps the result.
    return function_info(func)


# Arguments an op updates in place (BatchNorm's running statistics): cast like inputs, the update would go into a
# temporary copy and the buffers would never change. They are cast for the op and the result is copied back.
_UPDATED_ARGS: dict[Any, tuple[tuple[int, ...], tuple[str, ...]]] = {
    F.batch_norm: ((1, 2), ("running_mean", "running_var")),
    F.instance_norm: ((1, 2), ("running_mean", "running_var")),
    torch.batch_norm: ((3, 4), ("running_mean", "running_var")),
    torch.instance_norm: ((3, 4), ("running_mean", "running_var")),
}


def _cast_updated(func: Any, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict, list]:
    positions, names = _UPDATED_ARGS[func]
    written: list[tuple[Tensor, Tensor]] = []

    def cast(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
            copy = value.to(dtype)
            written.append((value, copy))
            return copy
        return value

    args = tuple(cast(a) if i in positions else a for i, a in enumerate(args))
    kwargs = {k: cast(v) if k in names else v for k, v in kwargs.items()}
    return args, kwargs, written


class _PolicyMode(TorchFunctionMode):
    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__()
        self.policy = policy

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        policy = self.policy
        compiling = torch.compiler.is_compiling()
        cls, inplace = _traced_function_info(func)
        if cls in _NEVER_CAST or _SUSPENDED[0]:
            return func(*args, **kwargs)
        stack = policy._module_stack
        dtype = stack[-1] if stack else policy._class_dtypes[cls]
        if dtype is None or inplace or "out" in kwargs:
            out = func(*args, **kwargs)
        else:
            written: list[tuple[Tensor, Tensor]] = []
            if func in _UPDATED_ARGS:
                args, kwargs, written = _cast_updated(func, args, kwargs, dtype)
            args = tuple(_cast(a, dtype) for a in args)
            if kwargs:
                kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
            if not policy._autocast_devices:
                out = func(*args, **kwargs)
            elif compiling:
                # The policy, not autocast, decides: autocast would recast the inputs we just cast.
                with torch.autocast(policy._autocast_devices[0], enabled=False):
                    out = func(*args, **kwargs)
            else:
                # Same as the context manager above at a fraction of its Python cost, on every governed op; a region
                # where the user turned autocast off stays off.
                device = policy._autocast_devices[0]
                enabled = torch.is_autocast_enabled(device)
                if enabled:
                    torch.set_autocast_enabled(device, False)
                try:
                    out = func(*args, **kwargs)
                finally:
                    if enabled:
                        torch.set_autocast_enabled(device, True)
            if written:
                with torch.no_grad():
                    for buffer, copy in written:
                        buffer.copy_(copy)
        if not compiling and policy._census is not None:
            policy._census.record(cls, out)
        return out


def _keep_out_of_dynamo_frames() -> None:
    # Dynamo inlines the mode while tracing a compiled region, with ``func`` a constant of the call site. Between graph
    # breaks it would also compile ``__torch_function__`` as a frame of its own, where the constant-folded op class
    # ignores ``func`` and a graph traced for one op is replayed for another (``Tensor.dtype`` returning 3). Skipping
    # that frame keeps the mode eager there and traced where it is inlined.
    from torch._dynamo.eval_frame import skip_code

    skip_code(_PolicyMode.__torch_function__.__code__)


def _match_weight_dtype(module: torch.nn.Module, args: tuple) -> tuple | None:
    # nn.LSTM/GRU/RNN check in Python that their input has their weights' dtype before the op the policy governs
    # runs; an input from a policy-cast op upstream (a bf16 GEMM) would fail that check.
    weight = next(iter(module.parameters()), None)
    if weight is None or not args or not isinstance(args[0], Tensor):
        return None
    if not args[0].is_floating_point() or args[0].dtype == weight.dtype:
        return None
    return (args[0].to(weight.dtype), *args[1:])


class PrecisionPolicy(Callback):
    """Run each operator class (matmul, norm, softmax, ...) in the dtype a policy gives it, and census what ran.

    A ``TorchFunctionMode`` entered around every training / validation / test / predict step sees each torch call,
    functional ones inside user code (``F.softmax``, ``x @ w``) included, casts its floating inputs to the dtype of
    its operator class (casts are differentiable; parameters keep their dtype) and runs it with autocast off, so the
    policy decides, identically on CPU and CUDA. ``"keep"`` leaves an op alone (autocast, if on, still applies).

    Args:
        rules: op class -> ``"fp32"`` | ``"bf16"`` | ``"fp16"`` | ``"keep"``, over the built-in table
            :data:`DEFAULT_RULES` (matmul, conv, attention, activation in bf16; norm, softmax, loss, reduction in
            fp32). ``None`` = the built-in table.
        default: dtype for classes that neither ``rules`` nor the built-in table names.
        modules: module-path glob -> dtype for every op inside that module; wins over ``rules``; the innermost
            (then most specific) matching module decides.
        census_every_n_steps: every this many training steps, record calls, dtypes and headroom per class and log
            them to TensorBoard; 0 = off.

    Example:
        >>> policy = PrecisionPolicy(rules={"activation": "fp32"}, modules={"head": "fp32"})
    """

    def __init__(
        self,
        rules: Optional[dict[OpClassName, DtypeName]] = None,
        default: DtypeName = "keep",
        modules: Optional[dict[str, DtypeName]] = None,
        census_every_n_steps: int = 100,
    ) -> None:
        valid = list(DTYPES)
        governed = [c for c in OP_CLASSES if c not in _NEVER_CAST]
        if not isinstance(default, str) or default not in DTYPES:
            raise ValueError(f"Expected `default` to be one of {valid}, but got {default!r}")
        if rules is not None and not isinstance(rules, dict):
            raise ValueError(f"Expected `rules` to be a dict of op class -> dtype (for example {{'matmul': 'bf16'}})"
                             f" or None, but got {rules!r}")
        for key, value in (rules or {}).items():
            if key in _NEVER_CAST:
                raise ValueError(f"`rules` cannot set op class {key!r}: the policy never casts it. Valid classes are"
                                 f" {governed}")
            if not isinstance(key, str) or key not in OP_CLASSES:
                raise ValueError(f"`rules` names unknown op class {key!r}; valid classes are {governed}")
            if not isinstance(value, str) or value not in DTYPES:
                raise ValueError(f"`rules[{key!r}]` is {value!r}; expected one of {valid}")
        if modules is not None and not isinstance(modules, dict):
            raise ValueError(f"Expected `modules` to be a dict of module glob -> dtype (for example"
                             f" {{'model.head': 'fp32'}}) or None, but got {modules!r}")
        for key, value in (modules or {}).items():
            if not isinstance(key, str) or not isinstance(value, str) or value not in DTYPES:
                raise ValueError(f"`modules[{key!r}]` is {value!r}; expected one of {valid}")
        check_int("census_every_n_steps", census_every_n_steps, 0)
        self.rules = dict(rules) if rules is not None else None
        self.default = default
        self.modules = dict(modules or {})
        self.census_every_n_steps = census_every_n_steps
        table = {cls: DEFAULT_RULES.get(cls, default) for cls in OP_CLASSES}
        table.update(self.rules or {})
        table.update(dict.fromkeys(_NEVER_CAST, "keep"))
        self.table: dict[str, str] = table
        #: the last census: ``{(class, dtype name): {"calls", "absmax", "headroom_bits"}}``
        self.census: dict[tuple[str, str], dict[str, float]] = {}

        self._class_dtypes = {cls: DTYPES[name] for cls, name in table.items()}
        self._module_stack: list[torch.dtype | None] = []
        self._autocast_devices: list[str] = []
        self._census: _Census | None = None  # recording now
        self._census_done: _Census | None = None  # recorded this batch, logged at its end
        self._census_step = False
        self._mode = _PolicyMode(self)
        self._patches = Patches()
        self._writer: TensorBoardWriter | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(rules=self.rules, modules=self.modules)

    def dtype_for(self, op_class: str, module: str | None = None) -> str:
        """The dtype name an op of ``op_class`` runs in, inside the module at path ``module`` (if any).

        Args:
            op_class: one of :data:`~lightning_opkit.opclass.OP_CLASSES`.
            module: a module path, or ``None`` for code outside any overridden module.
        """
        if op_class in _NEVER_CAST:
            return "keep"
        override_ = match_rule(module, self.modules) if module is not None else None
        return override_ if override_ is not None else self.table[op_class]

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()
        matched = resolve_modules(pl_module, self.modules, owner="PrecisionPolicy") if self.modules else []
        if stage == "fit":
            self._check_fp16(trainer, matched)
        _keep_out_of_dynamo_frames()
        for module in pl_module.modules():
            if isinstance(module, torch.nn.RNNBase):
                self._patches.hold(module.register_forward_pre_hook(_match_weight_dtype))
        for name, module in matched:
            dtype = DTYPES[match_rule(name, self.modules)]  # type: ignore[index]
            self._patches.hold(module.register_forward_pre_hook(self._push(dtype)))
            self._patches.hold(module.register_forward_hook(self._pop, always_call=True))
        for method in _STEP_METHODS:
            # Lightning runs a validation/test loop only if the user overrode its step: a wrapper must not look like
            # an override of a method the user never wrote (predict_step's default does run, so it is governed).
            if method in ("validation_step", "test_step") and not is_overridden(method, pl_module):
                continue
            original = getattr(pl_module, method)
            self._patches.set(pl_module, method, self._wrap(trainer, original, method == "training_step"))
        self._writer = TensorBoardWriter(trainer)
        if stage == "fit":
            start_summary(self, trainer, self._writer)
        rows = [[cls, self.table[cls]] for cls in OP_CLASSES] + [[f"module {k}", v] for k, v in self.modules.items()]
        self._writer.table("opkit/precision/policy", ["op class / module", "dtype"], rows, trainer.global_step)

    def _check_fp16(self, trainer: pl.Trainer, matched: list[tuple[str, torch.nn.Module]]) -> None:
        users = [cls for cls, name in self.table.items() if name == "fp16"]
        users += [f"module {name}" for name, _ in matched if match_rule(name, self.modules) == "fp16"]
        if users and getattr(trainer.precision_plugin, "scaler", None) is None:
            raise ValueError(
                f"PrecisionPolicy runs {users} in fp16, which needs loss scaling, but Trainer(precision="
                f"{trainer.precision!r}) has no GradScaler. Use Trainer(precision='16-mixed') (its GradScaler scales"
                f" the loss), or run those in 'bf16', which has fp32's range."
            )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            end_summary(self, trainer, self._writer)
        self._detach()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        end_summary(self, trainer, self._writer, exception)
        self._detach()

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        by_dtype: dict[str, list[str]] = {}
        for cls in OP_CLASSES:
            if cls not in _NEVER_CAST:
                by_dtype.setdefault(self.table[cls], []).append(cls)
        lines = ["precision policy: " + "; ".join(f"{', '.join(v)} in {k}" for k, v in by_dtype.items())]
        if self.modules:
            lines.append("  module overrides: " + ", ".join(f"{k} -> {v}" for k, v in self.modules.items()))
        return lines

    def _detach(self) -> None:
        self._patches.restore()
        self._module_stack.clear()
        self._census = self._census_done = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _push(self, dtype: torch.dtype | None) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._module_stack.append(dtype)

        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def _wrap(self, trainer: pl.Trainer, step: Callable[..., Any], is_training: bool) -> Callable[..., Any]:
        def run_step(*args: Any, **kwargs: Any) -> Any:
            self._module_stack.clear()
            self._autocast_devices = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
            census = None
            if is_training and self._census_step:
                # Only the batch's own step is counted, not a NaNDetector replay of it.
                self._census_step = False
                census = self._census = _Census()
            # A census step runs eagerly even where TorchCompile compiled the model, so every op is counted;
            # only census steps pay for that.
            eager = torch.compiler.set_stance("force_eager") if census is not None else contextlib.nullcontext()
            try:
                with eager, self._mode:
                    return step(*args, **kwargs)
            finally:
                if census is not None:
                    self._census, self._census_done = None, census

        return run_step

    # census

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        n = self.census_every_n_steps
        self._census_step = n > 0 and trainer.global_step % n == 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        census, self._census_done = self._census_done, None
        if census is None:
            return
        rows = sorted(census.rows(), key=lambda r: (OP_CLASSES.index(r[0]), r[1]))
        self.census = {(cls, dt): {"calls": calls, "absmax": peak, "headroom_bits": head}
                       for cls, dt, calls, peak, head in rows}
        step = trainer.global_step
        near = [(cls, dt, head) for cls, dt, _, _, head in rows if dt in ("fp16", "bf16") and head < _WARN_BITS]
        for cls, dt, head in near:
            rank_zero_warn(f"PrecisionPolicy: op class {cls!r} in {dt} is {head:.1f} bits from overflow at step {step}"
                           f" (max |output| near finfo({dt}).max); consider running it in 'fp32'.")
        if self._writer is None:
            return
        for cls in dict.fromkeys(r[0] for r in rows):
            heads = [r[4] for r in rows if r[0] == cls]
            self._writer.scalar(f"opkit/precision/{cls}/headroom_bits", min(heads), step)
            self._writer.scalar(f"opkit/precision/{cls}/calls", sum(r[2] for r in rows if r[0] == cls), step)
        table = markdown_table(
            ["op class", "class rule", "ran in", "calls", "max abs output", "headroom bits"],
            [[cls, self.table[cls], dt, calls, peak, head] for cls, dt, calls, peak, head in rows],
        )
        if near:
            table += "\n\n**Near overflow:** " + ", ".join(f"{c} in {d} ({h:.1f} bits)" for c, d, h in near)
        self._writer.text("opkit/precision/census", table, step)
        self._writer.flush()
