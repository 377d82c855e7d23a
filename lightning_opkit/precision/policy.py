"""PrecisionPolicy: decide the dtype of each operator class (and each module), and show what actually ran."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from lightning_opkit._checks import check_bools, check_fraction, check_int
from lightning_opkit._patch import Patches
from lightning_opkit._replay import loss_of
from lightning_opkit._select import match_rule, resolve_modules
from lightning_opkit._summary import end_summary, start_summary
from lightning_opkit._tensorboard import TensorBoardWriter, markdown_table
from lightning_opkit.opclass import OP_CLASSES
from lightning_opkit.precision.candidates import StepChoice, candidate_tables, choose_table, first_rows
from lightning_opkit.precision.census import Census, merge_rows
from lightning_opkit.precision.decide import DEFAULT_TOLERANCE, MIN_SPEEDUP, Decision, decide
from lightning_opkit.precision.dtypes import (
    DTYPES,
    GOVERNED,
    NEVER_CAST,
    DtypeName,
    OpClassName,
    describe_device,
    hardware_note,
)
from lightning_opkit.precision.function_mode import ModeState, PolicyMode, keep_out_of_dynamo_frames, match_weight_dtype
from lightning_opkit.precision.measure import (
    Measurement,
    OpLog,
    PrecisionMeasurements,
    StepRunner,
    measure_precision,
    speed_phrase,
    time_classes,
)
from lightning_opkit.precision.trials import Trials

__all__ = ["DEFAULT_RULES", "PrecisionPolicy"]

#: GEMMs and GELU-like activations on Tensor Cores in bf16; variance, exponent and large-sum ops in fp32.
DEFAULT_RULES: dict[str, str] = {
    "matmul": "bf16", "conv": "bf16", "attention": "bf16", "activation": "bf16",
    "norm": "fp32", "softmax": "fp32", "loss": "fp32", "reduction": "fp32",
}
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_ASIDE = "nothing lowered on this fp32 model: the policy stands aside (the model runs as written, no census)"
_WARN_BITS = 4.0


class PrecisionPolicy(Callback):
    """Run each operator class (matmul, norm, softmax, ...) in the dtype a policy gives it, and census what ran.

    A ``TorchFunctionMode`` entered around every training / validation / test / predict step sees each torch call,
    functional ones inside user code (``F.softmax``, ``x @ w``) included, casts its floating inputs to the dtype of
    its operator class (casts are differentiable; parameters keep their dtype) and runs it with autocast off, so the
    policy decides, identically on CPU and CUDA. ``"keep"`` leaves an op alone (autocast, if on, still applies).

    With ``rules="auto"`` the policy measures, on the first training batch, each class's speed in fp32 and 16-bit
    dtypes on this device at this model's shapes and the error of lowering it alone (:func:`measure_precision`), and
    runs each class in the fastest 16-bit dtype that is at least 5% faster than fp32 and within ``tolerance``, else
    in fp32 (:func:`decide`). Until then (the sanity check) every class runs in fp32.

    Args:
        rules: ``"auto"``, or op class -> ``"fp32"`` | ``"bf16"`` | ``"fp16"`` | ``"keep"`` over the built-in table
            :data:`DEFAULT_RULES` (matmul, conv, attention, activation in bf16; norm, softmax, loss, reduction in
            fp32). ``None`` = the built-in table.
        default: dtype for classes that neither ``rules`` nor the built-in table names (not used by ``"auto"``).
        modules: module-path glob -> dtype for every op inside that module; wins over ``rules``; the innermost
            (then most specific) matching module decides.
        census_every_n_steps: every this many training steps, record calls, dtypes, error against fp32 recomputes,
            underflow and fp16 headroom per class and log them to TensorBoard; 0 = off.
        tolerance: with ``rules="auto"``, the largest relative loss change and the largest ``1 - cosine`` of the
            gradients that lowering one class may cause.
        measure_every_n_steps: with ``rules="auto"``, measure and decide again every this many steps; 0 = once, at the
            first training batch of each fit.
        check_speed: with explicit rules, time each class set to a 16-bit dtype at the ops and shapes the first
            training step ran (after it, without running the model again) and warn once if it is slower than fp32.
        whole_step: with ``rules="auto"``, confirm the choice on the whole step: run a few candidate tables (all-fp32,
            GEMMs in 16-bit with the rest ``keep``, the per-class pick, the pick with ``keep``) on the first rows of
            the batch, and train with the fastest within ``tolerance`` as a whole (loss change, gradient cosine);
            ``False``: each class alone, as timed op by op and lowered alone.
        trial_rounds: with ``whole_step``, confirm the candidates that come close on the measured rows on the next
            real training steps: each runs this many steps (they train as usual) and the fastest median trains on;
            0 = take the choice on the measured rows. Not under TorchCompile (each table would recompile) nor with
            gradient accumulation.

    Example:
        >>> policy = PrecisionPolicy(rules={"activation": "fp32"}, modules={"head": "fp32"})
        >>> auto = PrecisionPolicy(rules="auto", tolerance=0.02)
    """

    def __init__(
        self,
        rules: Union[Literal["auto"], dict[OpClassName, DtypeName], None] = None,
        default: DtypeName = "keep",
        modules: Optional[dict[str, DtypeName]] = None,
        census_every_n_steps: int = 100,
        tolerance: float = DEFAULT_TOLERANCE,
        measure_every_n_steps: int = 0,
        check_speed: bool = True,
        whole_step: bool = True,
        trial_rounds: int = 2,
    ) -> None:
        valid = list(DTYPES)
        governed = list(GOVERNED)
        if not isinstance(default, str) or default not in DTYPES:
            raise ValueError(f"Expected `default` to be one of {valid}, but got {default!r}")
        auto = rules == "auto"
        if not auto and rules is not None and not isinstance(rules, dict):
            raise ValueError(f"Expected `rules` to be 'auto', a dict of op class -> dtype (for example"
                             f" {{'matmul': 'bf16'}}) or None, but got {rules!r}")
        for key, value in (rules if isinstance(rules, dict) else {}).items():
            if key in NEVER_CAST:
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
        check_int("measure_every_n_steps", measure_every_n_steps, 0)
        check_int("trial_rounds", trial_rounds, 0)
        check_bools(check_speed=check_speed, whole_step=whole_step)
        check_fraction("tolerance", tolerance, "relative loss change and 1 - gradient cosine")
        self.rules: str | dict[str, str] | None = "auto" if auto else (dict(rules) if rules is not None else None)
        self.default = default
        self.modules = dict(modules or {})
        self.census_every_n_steps = census_every_n_steps
        self.tolerance = float(tolerance)
        self.measure_every_n_steps = measure_every_n_steps
        self.check_speed = check_speed
        self.whole_step = whole_step
        self.trial_rounds = trial_rounds
        if auto:
            table = dict.fromkeys(GOVERNED, "fp32")  # until measured
        else:
            table = {cls: DEFAULT_RULES.get(cls, default) for cls in OP_CLASSES}
            table.update(rules or {})  # type: ignore[arg-type]
        table.update(dict.fromkeys(NEVER_CAST, "keep"))
        self.table: dict[str, str] = table
        #: the last census: ``{(class, dtype name): {"calls", "absmax", "rel_error", "underflow_frac",
        #: "headroom_bits", "override"}}``; error and underflow for 16-bit rows, headroom for fp16 rows, else ``None``
        self.census: dict[tuple[str, str], dict[str, Any]] = {}
        #: the last measurements (``rules="auto"``, or the speed check of explicit rules)
        self.measurements: PrecisionMeasurements | None = None
        #: with ``rules="auto"``: op class -> the decision and its evidence
        self.decisions: dict[str, Decision] = {}
        #: with ``rules="auto"`` and ``whole_step``: the candidate tables, their times and errors, and the one chosen
        self.choice: StepChoice | None = None

        self._state = ModeState(table)
        self._census_done: Census | None = None  # recorded this batch, logged at its end
        self._speed_log: OpLog | None = None  # to record the next training step's ops (the speed check)
        self._speed_recorded: OpLog | None = None  # what it recorded, timed at the batch's end
        self._census_step = False
        self._measured_at: int | None = None
        self._per_class: dict[str, tuple[str, str]] = {}  # rank zero's per-class decisions: (dtype, why)
        self._trials: Trials | None = None  # contenders timed on the next training steps
        self._trial_step: tuple[str, float] | None = None  # the contender of this batch and when it began
        self._mode = PolicyMode(self._state)
        self._originals: dict[str, Callable[..., Any]] = {}
        self._forced: list[torch.dtype | None] = []  # a dtype for the whole step (running_in(None, ...))
        self._passthrough = False  # rules="auto" decided fp32 everywhere on an fp32 model, or plain autocast
        self._autocast: str | None = None  # rules="auto" chose plain autocast in this dtype
        self._autocast_device = "cpu"
        self._overriding = 0  # running_in() contexts open: the mode must run
        self._patches = Patches()
        self._writer: TensorBoardWriter | None = None

    @property
    def measure_seconds(self) -> float:
        """What the last ``rules="auto"`` measurement cost at fit start: per-class timing plus the candidate runs."""
        if self.measurements is None:
            return 0.0
        return self.measurements.seconds + (self.choice.seconds if self.choice is not None else 0.0)

    @property
    def auto(self) -> bool:
        """Whether the dtypes are measured and decided (``rules="auto"``)."""
        return self.rules == "auto"

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
        if op_class in NEVER_CAST:
            return "keep"
        override_ = match_rule(module, self.modules) if module is not None else None
        return override_ if override_ is not None else self.table[op_class]

    @contextlib.contextmanager
    def running_in(self, module: torch.nn.Module | None, dtype: DtypeName) -> Any:
        """Inside, every op in ``module`` (``None``: in the whole step) runs in ``dtype``; NaN cause replays use it.

        Args:
            module: a submodule of the model this policy is attached to, or ``None``.
            dtype: the dtype name.
        """
        patches = Patches()
        self._overriding += 1
        if module is None:
            self._forced.append(DTYPES[dtype])
        else:
            patches.hold(module.register_forward_pre_hook(self._push(DTYPES[dtype])))  # after the overrides: wins
            patches.hold(module.register_forward_hook(self._pop, always_call=True))
        try:
            yield
        finally:
            patches.restore()
            self._overriding -= 1
            if module is None:
                self._forced.pop()

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()
        matched = resolve_modules(pl_module, self.modules, owner="PrecisionPolicy") if self.modules else []
        if stage == "fit":
            self._check_fp16(trainer, matched)
        keep_out_of_dynamo_frames()
        for module in pl_module.modules():
            if isinstance(module, torch.nn.RNNBase):
                self._patches.hold(module.register_forward_pre_hook(match_weight_dtype))
        for name, module in matched:
            dtype = DTYPES[match_rule(name, self.modules)]  # type: ignore[index]
            self._patches.hold(module.register_forward_pre_hook(self._push(dtype)))
            self._patches.hold(module.register_forward_hook(self._pop, always_call=True))
        for method in _STEP_METHODS:
            # Lightning runs a validation/test loop only if the user overrode its step: a wrapper must not look like
            # an override of a method the user never wrote (predict_step's default does run, so it is governed).
            if method in ("validation_step", "test_step") and not is_overridden(method, pl_module):
                continue
            original = self._originals[method] = getattr(pl_module, method)
            self._patches.set(pl_module, method, self._wrap(trainer, original, method == "training_step"))
        self._writer = TensorBoardWriter(trainer)
        self._measured_at = None
        self._passthrough = False
        self._autocast = None
        self._trials = self._trial_step = None
        if stage == "fit":
            start_summary(self, trainer, self._writer)
        self._log_table(trainer.global_step)

    def _log_table(self, step: int) -> None:
        if self._writer is None:
            return
        rows = [[cls, self.table[cls], self.decisions[cls].reason if cls in self.decisions else "-"]
                for cls in OP_CLASSES]
        rows += [[f"module {k}", v, "module override"] for k, v in self.modules.items()]
        text = markdown_table(["op class / module", "dtype", "why"], rows)
        if self.auto and not self.decisions:
            text = "rules='auto': every class in fp32 until measured at the first training batch.\n\n" + text
        self._writer.text("opkit/precision/policy", text, step)

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
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trials is not None and self.choice is not None:
            # The fit ended before every contender had its steps: the choice on the measured rows stands.
            taken, total = self._trials.taken, len(self._trials.order)
            self.choice.trial = f"not finished (the fit ended after {taken} of {total} trial steps)"
            self._trials = self._trial_step = None
            self._apply_candidate(pl_module, self.choice.chosen)
            self._log_decision(trainer.global_step)

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
        for cls in GOVERNED:
            if not self.decisions or cls in self.decisions:  # under auto: the classes the model ran
                by_dtype.setdefault(self.table[cls], []).append(cls)
        head = "precision policy"
        if self.auto and self.measurements is not None:
            head += f" (auto, measured in {self.measure_seconds:.1f} s on {self.measurements.device})"
        lines = [head + ": " + "; ".join(f"{', '.join(v)} {'keep' if k == 'keep' else 'in ' + k}"
                                         for k, v in by_dtype.items())]
        if self._autocast is not None:
            lines[0] = (f"{head}: plain torch.autocast in {self._autocast} (what bf16-mixed runs), the fastest within"
                        f" tolerance here; the policy's mode stands aside")
        if self.choice is not None:
            lines.append(f"  {self.choice.comparison()}")
        if self.modules:
            lines.append("  module overrides: " + ", ".join(f"{k} -> {v}" for k, v in self.modules.items()))
        if self._passthrough:
            lines.append(f"  {_ASIDE}")
        return lines

    def _detach(self) -> None:
        self._patches.restore()
        self._originals.clear()
        self._state.module_stack.clear()
        self._state.census = self._census_done = None
        self._speed_log = self._speed_recorded = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _push(self, dtype: torch.dtype | None) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._state.module_stack.append(dtype)

        return hook

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._state.module_stack:
            self._state.module_stack.pop()

    def _runs_mode(self, is_training: bool) -> bool:
        """Whether this step runs under the policy's mode (else the model runs as written, or under autocast)."""
        if self._overriding or not self._passthrough:
            return True  # a NaN cause replay's fp32 region, or a table to apply
        if self._autocast is not None:
            return is_training and self._census_step  # census steps count what autocast ran (an all-keep table)
        return bool(self._state.autocast_devices)  # fp32 decided, but the Trainer's autocast would lower ops

    def _wrap(self, trainer: pl.Trainer, step: Callable[..., Any], is_training: bool) -> Callable[..., Any]:
        state = self._state

        def run_step(*args: Any, **kwargs: Any) -> Any:
            device = self._autocast_device
            if self._autocast is not None and not torch.is_autocast_enabled(device):
                # rules="auto" chose plain autocast: the step runs as under precision="bf16-mixed".
                with torch.autocast(device, dtype=DTYPES[self._autocast]):
                    return governed(*args, **kwargs)
            return governed(*args, **kwargs)

        def governed(*args: Any, **kwargs: Any) -> Any:
            state.module_stack.clear()
            state.module_stack.extend(self._forced)
            state.autocast_devices = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
            if not self._runs_mode(is_training):
                self._census_step = False  # the policy runs nothing: nothing to count either
                return step(*args, **kwargs)
            census = None
            log = None
            if is_training and self._speed_log is not None:
                log, self._speed_log = self._speed_log, None  # this step's own run only, not a NaN replay of it
            if is_training and self._census_step:
                # Only the batch's own step is counted, not a NaNDetector replay of it.
                self._census_step = False
                census = state.census = Census()
            # A census step runs eagerly even where TorchCompile compiled the model, so every op is counted;
            # only census steps pay for that.
            # The recording step of the speed check runs eagerly too: its log sees each op as the model called it.
            eager = (torch.compiler.set_stance("force_eager") if census is not None or log is not None
                     else contextlib.nullcontext())
            try:
                with eager, self._mode, log or contextlib.nullcontext():
                    return step(*args, **kwargs)
            finally:
                if census is not None:
                    state.census, self._census_done = None, census
                if log is not None:
                    self._speed_recorded = log

        return run_step

    # measurement

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        n = self.census_every_n_steps
        self._census_step = n > 0 and trainer.global_step % n == 0
        step = trainer.global_step
        if self._trials is not None and self._measured_at != step:
            self._start_trial_step(pl_module)
        if self._measured_at == step:
            return  # gradient accumulation: one measurement per optimizer step
        every = self.measure_every_n_steps
        if self.auto and (self._measured_at is None or (every and step % every == 0)):
            self._measured_at = step
            self._measure_and_decide(trainer, pl_module, batch, batch_idx)
        elif not self.auto and self.check_speed and self._measured_at is None:
            self._measured_at = step
            if any(self.table[c] in ("bf16", "fp16") for c in GOVERNED):
                self._speed_log = OpLog()  # filled by this batch's own training step, timed at its end

    def _loss_fn(self, batch_idx: int) -> Callable[[torch.nn.Module, Any], Tensor]:
        step = self._originals["training_step"]

        def loss_fn(model: torch.nn.Module, b: Any) -> Tensor:
            loss = loss_of(step(b, batch_idx))
            if loss is None:
                raise ValueError("training_step returned no loss")
            return loss

        return loss_fn

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                 **kwargs: Any) -> PrecisionMeasurements | None:
        if not pl_module.automatic_optimization:
            # Its training_step steps the optimizers itself: running it again would train on the batch again.
            rank_zero_warn("PrecisionPolicy cannot measure a model with manual optimization (its training_step steps"
                           " the optimizers); the policy keeps its table.")
            return None
        try:
            return measure_precision(pl_module, lambda: batch, device=pl_module.device,
                                     loss_fn=self._loss_fn(batch_idx), **kwargs)
        except Exception as err:  # a measurement that fails must not end the training it was meant to speed up
            rank_zero_warn(f"PrecisionPolicy could not measure this model ({type(err).__name__}: {err}); the policy"
                           f" keeps its table{' (every class in fp32)' if self.auto else ''}.")
            return None

    def _choose(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                rows: list[Measurement], per_class: dict[str, str], dtypes: list[str]) -> StepChoice | None:
        """Run the whole-step candidates on the first rows of ``batch`` and choose one (``None`` if that fails)."""
        low = per_class["matmul"] if per_class.get("matmul") in dtypes else dtypes[0]
        tables = candidate_tables(per_class, sorted(per_class, key=OP_CLASSES.index), low)
        sub, n = first_rows(batch)
        runner = StepRunner(pl_module, sub, self._loss_fn(batch_idx))
        try:
            with runner.session():
                return choose_table(runner, tables, rows, self.tolerance, n, low,
                                    agree=lambda value: trainer.strategy.broadcast(value, src=0),
                                    compiled=self._compiled(trainer))
        except Exception as err:
            rank_zero_warn(f"PrecisionPolicy could not run the whole-step candidates ({type(err).__name__}: {err});"
                           f" it keeps the per-class decisions.")
            return None

    def _measure_and_decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                            batch_idx: int) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None) is not None
        dtypes = ["bf16", "fp16"] if scaler else ["bf16"]  # fp16 only where a GradScaler scales the loss
        if self.whole_step:
            # Per-class timings on the rows the candidates run on: they only rank and prune the candidates, whose
            # own runs decide; errors are measured per table, as a whole.
            sub, _ = first_rows(batch)
            measurements = self._measure(trainer, pl_module, sub, batch_idx, dtypes=dtypes, errors=False, reps=3)
        else:
            measurements = self._measure(trainer, pl_module, batch, batch_idx, dtypes=dtypes)
        decisions: dict[str, Decision] = {}
        if measurements is not None:
            decisions = decide(measurements, self.tolerance, dtypes, require_errors=not self.whole_step)
        # Every rank measures (a SyncBatchNorm's collectives need every rank in each forward); every rank runs what
        # rank zero decided: the same numerics, the same compiled graphs.
        chosen = trainer.strategy.broadcast({c: (d.dtype, d.reason) for c, d in decisions.items()}, src=0)
        choice = None
        if self.whole_step and chosen:
            # The candidates come from rank zero's per-class decisions, so every rank runs the same tables.
            choice = self._choose(trainer, pl_module, batch, batch_idx, measurements.rows if measurements else [],
                                  {c: d for c, (d, _) in chosen.items()}, dtypes)
            choice = trainer.strategy.broadcast(choice, src=0)
        self._per_class = chosen
        self.choice = choice
        self.measurements = measurements
        if choice is None:
            self._apply(pl_module, chosen)
        else:
            self._apply_candidate(pl_module, choice.chosen)
        self._trials = None
        if choice is not None and self.trial_rounds and len(choice.contenders()) > 1:
            if self._compiled(trainer) or trainer.accumulate_grad_batches > 1:
                choice.trial = "not run (" + ("TorchCompile attached: each table would recompile" if
                                              self._compiled(trainer) else "gradient accumulation") + ")"
            else:
                self._trials = Trials(choice.contenders(), self.trial_rounds)
        self._log_decision(trainer.global_step)
        if self._writer is not None and measurements is not None:
            self._writer.scalar("opkit/precision/measure_s", self.measure_seconds, trainer.global_step)

    def _apply(self, pl_module: pl.LightningModule, chosen: dict[str, tuple[str, str]],
               autocast: str | None = None) -> None:
        """Run the decided dtypes from now on: op class -> (dtype name, why); or plain autocast in ``autocast``."""
        self._autocast, self._autocast_device = autocast, pl_module.device.type
        self.decisions = {c: Decision(c, d, why) for c, (d, why) in chosen.items()}
        table = dict(self.table)
        # Classes the model was not seen to run: fp32, or under plain autocast whatever autocast does with them.
        table.update(dict.fromkeys(GOVERNED, "fp32" if autocast is None else "keep"))
        table.update({c: d.dtype for c, d in self.decisions.items()})
        self.table = table
        self._state.set_table(table)
        # Nothing worth lowering on an fp32 model without autocast: the model runs as written, without the mode's
        # per-op cost (~2% of a step on the example) and without a census. NaN cause replays still enter it.
        self._passthrough = not self.modules and (autocast is not None or (
            all(table[c] == "fp32" for c in GOVERNED)
            and all(t.dtype == torch.float32 for t in (*pl_module.parameters(), *pl_module.buffers())
                    if t.is_floating_point())))

    @staticmethod
    def _compiled(trainer: pl.Trainer) -> bool:
        return any(type(c).__name__ == "TorchCompile" for c in trainer.callbacks)  # type: ignore[attr-defined]

    def _apply_candidate(self, pl_module: pl.LightningModule, name: str) -> None:
        """Run candidate ``name`` of the current choice from now on."""
        assert self.choice is not None
        run = next(r for r in self.choice.runs if r.name == name)
        # Plain autocast leaves every class to autocast: "keep" for the policy, whose mode stands aside.
        table = run.table or dict.fromkeys(self._per_class, "keep")
        what = f"plain torch.autocast in {run.autocast}" if run.autocast else f"table '{run.name}'"
        self._apply(pl_module, {c: (table[c], f"{what} ({run.figures()}); per class:"
                                              f" {self._per_class[c][1] if c in self._per_class else '-'}")
                                for c in table}, run.autocast)

    def _start_trial_step(self, pl_module: pl.LightningModule) -> None:
        assert self._trials is not None
        if self._census_step:
            self._trial_step = None  # a census step recomputes every op in fp32: not a fair sample
            return
        name = self._trials.next()
        self._apply_candidate(pl_module, name)
        _sync(pl_module.device)
        self._trial_step = (name, time.perf_counter())

    def _end_trial_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trials, taken = self._trials, self._trial_step
        self._trial_step = None
        if trials is None or taken is None or self.choice is None:
            return
        _sync(pl_module.device)
        trials.add(taken[0], 1e3 * (time.perf_counter() - taken[1]))
        if not trials.done:
            return
        # Rank zero's step times decide, so every rank trains on with the same table.
        winner = trainer.strategy.broadcast(trials.winner(), src=0)
        self.choice.chosen, self.choice.trial = winner, trainer.strategy.broadcast(trials.describe(), src=0)
        self._trials = None
        self._apply_candidate(pl_module, winner)
        self._log_decision(trainer.global_step)

    def _log_decision(self, step: int) -> None:
        measurements = self.measurements
        if self._writer is None or measurements is None:
            return
        sensitivity = measurements.table({c: d.dtype for c, d in self.decisions.items()})
        if self.choice is not None:
            sensitivity += "\n\n" + self.choice.table()
        self._writer.text("opkit/precision/sensitivity", sensitivity, step)
        rows = [[c, d.dtype, d.reason] for c, d in self.decisions.items()]
        head = (f"tolerance {self.tolerance:g}, at least {MIN_SPEEDUP:.2f}x faster than fp32; measured on"
                f" {measurements.device}.\n\n")
        if self.choice is not None:
            head += f"{self.choice.comparison()}.\n\n"
        if self._passthrough:
            head += f"{_ASIDE}.\n\n"
        evidence = markdown_table(["op class", "dtype", "evidence"], rows)
        if self.choice is not None:
            evidence += "\n\n" + self.choice.table()
        self._writer.text("opkit/precision/decision", head + evidence, step)
        self._log_table(step)
        self._writer.flush()

    def _check_speed(self, trainer: pl.Trainer, pl_module: pl.LightningModule, log: OpLog) -> None:
        """Time the lowered classes at the ops and shapes the first training step ran; warn about slow ones."""
        lowered = [c for c in GOVERNED if self.table[c] in ("bf16", "fp16")]
        dtypes = sorted({self.table[c] for c in lowered})
        began = time.perf_counter()
        notes: list[str] = []
        try:
            rows = time_classes(log, pl_module.device, dtypes, classes=lowered, notes=notes)
        except Exception as err:  # timing must not end the run it times
            rank_zero_warn(f"PrecisionPolicy could not time this model's ops ({type(err).__name__}: {err}).")
            return
        # Each class timed in the dtype of its own rule only.
        rows = [r for r in rows if r.dtype == self.table[r.op_class]]
        measurements = PrecisionMeasurements(rows, describe_device(pl_module.device), seconds=time.perf_counter()
                                             - began, notes=notes)
        self.measurements = measurements
        slow = [r for r in measurements if r.speed is not None and r.speed > MIN_SPEEDUP]
        if slow:
            device = pl_module.device
            parts = []
            for r in sorted(slow, key=lambda r: -(r.speed or 0.0)):
                note = hardware_note(device, r.dtype)
                parts.append(f"{r.dtype} {r.op_class} is {speed_phrase(r)} than fp32" + (f" ({note})" if note else ""))
            rank_zero_warn(
                f"PrecisionPolicy: on this device ({describe_device(device, hardware=False)}), " + "; ".join(parts)
                + ". Measured at the shapes of this model's first training step, forward + backward. Use"
                " rules='auto' to choose each class's dtype by measurement, or set those classes to 'fp32';"
                " PrecisionPolicy(check_speed=False) turns this check off."
            )
        if self._writer is not None:
            self._writer.text("opkit/precision/sensitivity", measurements.table(
                {c: self.table[c] for c in lowered}), trainer.global_step)

    # census

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end_trial_step(trainer, pl_module)
        log, self._speed_recorded = self._speed_recorded, None
        if log is not None:
            self._check_speed(trainer, pl_module, log)
        census, self._census_done = self._census_done, None
        if census is None:
            return
        rows = census.rows()
        self.census = merge_rows(rows, lambda r: (r.op_class, r.dtype))
        step = trainer.global_step
        near = [r for r in rows if r.headroom_bits is not None and r.headroom_bits < _WARN_BITS]
        for r in near:
            rank_zero_warn(f"PrecisionPolicy: op class {r.op_class!r} in fp16 is {r.headroom_bits:.1f} bits from"
                           f" overflow at step {step} (max |output| near finfo(fp16).max); consider running it in"
                           f" 'fp32' or 'bf16'.")
        if self._writer is None:
            return
        for cls, figures in merge_rows(rows, lambda r: r.op_class).items():
            for name in ("calls", "rel_error", "underflow_frac", "headroom_bits"):
                if figures[name] is not None:
                    self._writer.scalar(f"opkit/precision/{cls}/{name}", figures[name], step)
        table = markdown_table(
            ["op class", "ran in", "decided by", "calls", "rel. error vs fp32", "underflow frac", "max abs output",
             "fp16 headroom bits"],
            [[r.op_class, r.dtype, "module override" if r.override else f"class rule ({self.table[r.op_class]})",
              r.calls, _sci(r.rel_error), _sci(r.underflow_frac), r.absmax,
              "-" if r.headroom_bits is None else r.headroom_bits] for r in rows],
        )
        if near:
            table += "\n\n**Near overflow:** " + ", ".join(f"{r.op_class} in fp16 ({r.headroom_bits:.1f} bits)"
                                                           for r in near)
        self._writer.text("opkit/precision/census", table, step)
        self._writer.flush()


def _sync(device: torch.device) -> None:
    # Trial steps only: a CUDA step's time is its kernels', not their launch.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sci(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"
