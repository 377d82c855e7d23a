"""PrecisionPolicy: decide the dtype of each operator class (and each module), and show what actually ran.

The callback orchestrates Trainer-free parts: argument checks and the starting table (:mod:`.config`), the decision
in force and what it installs on the model (:mod:`.in_force`), the function mode that casts (:mod:`.function_mode`),
``rules="auto"``'s measurement, candidates and trials (:mod:`.auto`), the explicit rules' speed check
(:mod:`.speed_check`) and the census (:mod:`.census`).

Logged (rank zero): ``opkit/precision/policy`` (the table, at setup and after each decision),
``opkit/precision/sensitivity`` and ``opkit/precision/decision`` (measurements, candidates and evidence),
``opkit/precision/measure_s``, and per census step ``opkit/precision/<class>/{calls, rel_error, underflow_frac,
headroom_bits}`` (scalars) and ``opkit/precision/census`` (table).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_opkit.core.callback import OpkitCallback
from lightning_opkit.core.deprecations import renamed
from lightning_opkit.core.facts import RunFacts, facts_of
from lightning_opkit.core.kit import CompilesRegions, measuring_besides, offering
from lightning_opkit.core.select import match_rule, resolve_modules
from lightning_opkit.precision.auto import AutoPrecision
from lightning_opkit.precision.candidates import StepChoice
from lightning_opkit.precision.census import merge_rows
from lightning_opkit.precision.config import (
    AUTOCAST_DTYPE,
    DEFAULT_RULES,
    check_policy_args,
    fit_checked,
    initial_table,
)
from lightning_opkit.precision.decide import DEFAULT_TOLERANCE, Decision
from lightning_opkit.precision.dtypes import NEVER_CAST, DtypeName, OpClassName
from lightning_opkit.precision.fp8 import (
    Float8Linears,
    Fp8Recipe,
    auto_candidates,
    check_fp8,
    fp8_lines,
    fp8_markdown,
    running_in,
)
from lightning_opkit.precision.fp8_measure import Fp8Ask
from lightning_opkit.precision.function_mode import keep_out_of_dynamo_frames
from lightning_opkit.precision.governor import StepGovernor
from lightning_opkit.precision.in_force import DecisionInForce
from lightning_opkit.precision.plan import Plan
from lightning_opkit.precision.results import PrecisionMeasurements
from lightning_opkit.precision.schedule import MeasureSchedule, PolicySteps
from lightning_opkit.precision.speed_check import lowered
from lightning_opkit.precision.view import (
    CHARTS,
    policy_markdown,
    record_facts,
    summary_lines,
    write_census,
    write_speed_check,
)

__all__ = ["DEFAULT_RULES", "PrecisionPolicy"]

class PrecisionPolicy(OpkitCallback):
    """Run each operator class (matmul, norm, softmax, ...) in the dtype a policy gives it, and census what ran.

    With no ``rules`` the built-in table applies, whatever the Trainer's ``precision``: matmul, conv, attention and
    activation in bf16 (fp16 under ``precision="16-mixed"``), norm, softmax, loss and reduction in fp32. A ``rules``
    dict is merged over that table, class by class: ``{"matmul": "fp32"}`` keeps conv, attention and activation in
    16-bit. To run only what you name in 16-bit, name the rest ``"fp32"`` (or pass ``default`` and name every class).

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
        overrides: module-path glob -> dtype for every op inside that module; wins over ``rules``; the innermost
            (then most specific) matching module decides. (Named ``modules`` before; that name warns, for one
            release: ``modules`` elsewhere in the kit selects where a callback acts.)
        census_every_n_steps: every this many training steps, record calls, dtypes, error against fp32 recomputes,
            underflow and fp16 headroom per class and log them to TensorBoard; 0 = off.
        tolerance: with ``rules="auto"``, the largest relative loss change and the largest ``1 - cosine`` of the
            gradients that lowering one class may cause.
        remeasure_every_n_steps: with ``rules="auto"``, measure and decide again every this many steps; 0 = off (the
            decision made at the first training batch of each fit holds). (Was ``measure_every_n_steps``.)
        measure: measure before deciding. With ``rules="auto"`` the policy always measures (that is what it decides
            from); with explicit rules, time each class set to a 16-bit dtype at the ops and shapes the first
            training step ran (after it, without running the model again) and warn once if it is slower than fp32.
            (Was ``check_speed``.)
        whole_step: with ``rules="auto"``, confirm the choice on the whole step: run a few candidate tables (all-fp32,
            GEMMs in 16-bit with the rest ``keep``, the per-class pick, the pick with ``keep``) on the first rows of
            the batch, and train with the fastest within ``tolerance`` as a whole (loss change, gradient cosine);
            ``False``: each class alone, as timed op by op and lowered alone.
        trial_steps: with ``whole_step``, confirm the candidates that come close on the measured rows on the next
            real training steps: each runs this many steps (they train as usual) and the fastest median trains on;
            0 = take the choice on the measured rows. Not under TorchCompile (each table would recompile) nor with
            gradient accumulation; a census step, or a step another callback times its own alternatives on
            (ActivationCheckpointing's price), is no sample.
        fp8_recipe: torchao's float8 scaling where a rule or override says ``"fp8"``: ``"tensorwise"`` (one dynamic
            scale per tensor) or ``"rowwise"`` (one per row: finer, more to compute). See the fp8 section of the page.
        try_fp8: with ``rules="auto"``, measure each Linear in float8 (its GEMMs' time at this run's shapes against its
            class's dtype, and its error alone and with the others) and run it in float8 where it is 5% faster and
            within ``tolerance``. ``None``: where the device has float8 GEMM units (CUDA compute capability 8.9 or
            more); ``True``: on any device (a CPU measures it, slower); ``False``: never.
        fp8_all_gather: under FSDP2, gather the float8 modules' weights in float8 (torchao's float8 all-gather: a
            quarter of fp32's bytes, half of bf16's), from the fit's start; ``fp8_recipe="tensorwise"`` only.
        enabled: attach the callback; ``False`` (or its area, ``precision``, in the environment variable
            ``OPKIT_DISABLE``) leaves it attaching nothing, said once at setup.
        log_dir: where to write opkit's TensorBoard files when the Trainer has no TensorBoard logger (by default none
            then: ``logger=False`` writes no file).
        modules: the old name of ``overrides``: it works for this release and warns
            (:class:`~lightning_opkit.core.deprecations.OpkitDeprecationWarning`).
        measure_every_n_steps: the old name of ``remeasure_every_n_steps``, likewise.
        check_speed: the old name of ``measure``, likewise.
        trial_rounds: the old name of ``trial_steps`` (the kit's name for the steps each alternative of a timed
            trial runs, ActivationCheckpointing's too), likewise.

    Example:
        >>> policy = PrecisionPolicy(rules={"activation": "fp32"}, overrides={"head": "fp32"})
        >>> policy.table["activation"], policy.table["matmul"]  # merged over the built-in table
        ('fp32', 'bf16')
        >>> auto = PrecisionPolicy(rules="auto", tolerance=0.02)
    """

    area = "precision"

    def __init__(
        self,
        rules: Union[Literal["auto"], dict[OpClassName, DtypeName], None] = None,
        default: DtypeName = "keep",
        overrides: Optional[dict[str, DtypeName]] = None,
        census_every_n_steps: int = 100,
        tolerance: float = DEFAULT_TOLERANCE,
        remeasure_every_n_steps: int = 0,
        measure: bool = True,
        whole_step: bool = True,
        trial_steps: int = 2,
        fp8_recipe: Fp8Recipe = "tensorwise",
        try_fp8: Optional[bool] = None,
        fp8_all_gather: bool = False,
        enabled: bool = True,
        log_dir: Optional[str] = None,
        modules: Optional[dict[str, DtypeName]] = None,
        measure_every_n_steps: Optional[int] = None,
        check_speed: Optional[bool] = None,
        trial_rounds: Optional[int] = None,
    ) -> None:
        super().__init__(enabled, log_dir)
        name = type(self).__name__
        overrides = renamed(name, "modules", modules, "overrides", overrides, None)
        remeasure_every_n_steps = renamed(name, "measure_every_n_steps", measure_every_n_steps,
                                          "remeasure_every_n_steps", remeasure_every_n_steps, 0)
        measure = renamed(name, "check_speed", check_speed, "measure", measure, True)
        trial_steps = renamed(name, "trial_rounds", trial_rounds, "trial_steps", trial_steps, 2)
        check_policy_args(rules, default, overrides, tolerance,
                          counts=dict(census_every_n_steps=census_every_n_steps,
                                      remeasure_every_n_steps=remeasure_every_n_steps, trial_steps=trial_steps),
                          flags=dict(measure=measure, whole_step=whole_step))
        check_fp8(rules, overrides, fp8_recipe, try_fp8, fp8_all_gather)
        self.rules: str | dict[str, str] | None = "auto" if rules == "auto" else (
            dict(rules) if rules is not None else None)  # type: ignore[arg-type]
        self.default = default
        #: module glob -> dtype, over ``rules``
        self.overrides: dict[str, str] = dict(overrides or {})
        self.census_every_n_steps = census_every_n_steps
        self.tolerance = float(tolerance)
        self.remeasure_every_n_steps = remeasure_every_n_steps
        self.measure = measure
        self.whole_step = whole_step
        self.trial_steps = trial_steps
        #: the last census: ``{(class, dtype name): {"calls", "absmax", "rel_error", "underflow_frac",
        #: "headroom_bits", "override"}}``; error and underflow for 16-bit rows, headroom for fp16 rows, else ``None``
        self.census: dict[tuple[str, str], dict[str, Any]] = {}
        #: the speed check's measurements (explicit rules); under ``rules="auto"`` see :attr:`measurements`
        self._speed_measurements: PrecisionMeasurements | None = None
        self._auto = AutoPrecision(self.tolerance, whole_step, trial_steps)
        self.fp8_recipe, self.try_fp8, self.fp8_all_gather = fp8_recipe, try_fp8, fp8_all_gather
        table = initial_table(self.rules, default)
        self._governor = StepGovernor(table)
        #: the modules whose GEMMs run in float8 (``"fp8"`` rules and overrides), and those float8 could not take
        # a bound method, not a lambda: the callback pickles (ddp_spawn sends it to each process)
        self.fp8 = Float8Linears(fp8_recipe, census=self._governor.census, all_gather=fp8_all_gather)
        self._in_force = DecisionInForce(table, self._governor, self.fp8)

        self._facts: RunFacts | None = None
        self._schedule = MeasureSchedule(self.auto, measure, remeasure_every_n_steps)
        self._steps = PolicySteps(self._auto, self._schedule, self._governor)
        self._originals: dict[str, Callable[..., Any]] = {}

    @property
    def measurements(self) -> PrecisionMeasurements | None:
        """The last measurements (``rules="auto"``, or the speed check of explicit rules)."""
        return self._auto.measurements if self.auto else self._speed_measurements

    @property
    def table(self) -> dict[str, str]:
        """Op class -> the dtype name it runs in now (the rules, then each ``rules="auto"`` decision)."""
        return self._in_force.table

    @property
    def decisions(self) -> dict[str, Decision]:
        """With ``rules="auto"``: op class -> the decision in force and its evidence (empty until decided)."""
        return self._in_force.decisions

    @property
    def choice(self) -> StepChoice | None:
        """With ``rules="auto"`` and ``whole_step``: the candidate tables, their times and errors, the one chosen."""
        return self._auto.choice

    def loads_step(self, step: int) -> bool:
        """Whether training step ``step`` is a census step (every op recomputed in fp32: no timed sample there)."""
        return self.census_every_n_steps > 0 and step % self.census_every_n_steps == 0

    @property
    def measuring_steps(self) -> bool:
        """Whether contender tables are being timed on the training steps (the kit runs one such trial at a time)."""
        return self._auto.trialing

    @property
    def measure_seconds(self) -> float:
        """What the last ``rules="auto"`` measurement cost at fit start: per-class timing plus the candidate runs."""
        return self._auto.measure_seconds

    @property
    def auto(self) -> bool:
        """Whether the dtypes are measured and decided (``rules="auto"``)."""
        return self.rules == "auto"

    @property
    @override
    def state_key(self) -> str:
        # The key keeps its old shape (checkpoints written without overrides still load) but not the overrides: a fit
        # resumed with an override added (as a NaN repair advises) keeps its decision and applies the override on top
        return self._generate_state_key(rules=self.rules, modules={})

    def dtype_for(self, op_class: str, module: str | None = None) -> str:
        """The dtype name an op of ``op_class`` runs in, inside the module at path ``module`` (if any).

        Args:
            op_class: one of :data:`~lightning_opkit.opclass.OP_CLASSES`.
            module: a module path, or ``None`` for code outside any overridden module.
        """
        if op_class in NEVER_CAST:
            return "keep"
        inside = match_rule(module, self.overrides) if module is not None else None
        return inside if inside is not None else self.table[op_class]

    def running_in(self, module: torch.nn.Module | None, dtype: DtypeName) -> Any:
        """Inside, every op in ``module`` (``None``: in the whole step) runs in ``dtype``; NaN cause replays use it.

        Args:
            module: a submodule of the model this policy is attached to, or ``None``.
            dtype: the dtype name.
        """
        return running_in(self.fp8, self._governor, module, dtype)

    def pin(self, name: str, module: torch.nn.Module, dtype: DtypeName) -> None:
        """From now on every op inside ``module`` runs in ``dtype``: a module override added at run time.

        NaNDetector's repair pins a precision fault's culprit to fp32 through it; undone at teardown, like every
        override, and shown beside them.

        Args:
            name: the module's path.
            module: the module.
            dtype: the dtype name.
        """
        self._in_force.pin(self._patches, name, module, dtype)

    def layout(self) -> dict[str, dict[str, list[Any]]]:
        """The census charts (error, underflow, fp16 headroom, calls) and what measuring cost."""
        return {"opkit precision": dict(CHARTS)}

    def summary_lines(self) -> list[str]:
        """This callback's lines of the run summary."""
        overrides = self._in_force.labelled_overrides(self.overrides)
        governor = self._governor
        lines = summary_lines(self.table, self.decisions, overrides, governor.autocast, governor.aside(),
                              self._auto if self.auto else None)
        again = self.decision_as_arguments()
        lines += fp8_lines(self.fp8, self._auto.fp8_lines() if self.auto else None)
        return lines + ([f"  to run this decision again without measuring: {again}"] if again else [])

    @property
    def pinned(self) -> dict[str, str]:
        """Modules pinned at run time (:meth:`pin`, a NaN repair) -> dtype name."""
        return self._in_force.pinned

    # lifecycle

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()
        matched = resolve_modules(pl_module, self.overrides, argument="overrides", owner="PrecisionPolicy")
        if stage == "fit":
            # the 16-bit dtype the Trainer autocasts to; none where the device lacks its units and nothing asked for it
            self._in_force.start(fit_checked(self.rules, self.default, str(trainer.precision),
                                             trainer.strategy.root_device,
                                             {n: d for n, _ in matched if (d := match_rule(n, self.overrides))},
                                             getattr(trainer.precision_plugin, "scaler", None) is not None))
        keep_out_of_dynamo_frames()
        self._in_force.install(self._patches, pl_module, matched, self.overrides, trainer.strategy.root_device,
                               self.auto)
        self._originals = self._governor.govern_steps(self._patches, pl_module)
        self._open_writer(trainer, stage)
        self._facts = facts_of(trainer)
        self._record_facts()
        self._schedule.start()
        self._auto.reset()
        self._log_table(trainer.global_step)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fp8.gather_weights(pl_module, trainer.optimizers):  # FSDP2 shards in configure_model, after setup
            self._log_table(trainer.global_step)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if (plan := self._auto.abandon_trials()) is not None:
            self._apply(pl_module, plan)
            self._log_decision(trainer.global_step)

    @override
    def _release(self, trainer: pl.Trainer | None, pl_module: pl.LightningModule | None) -> None:
        self._originals.clear()
        self._in_force.release()

    # the plan: which ops run in which dtype

    def _apply(self, pl_module: pl.LightningModule, plan: Plan) -> None:
        """Run ``plan`` from now on (:meth:`.DecisionInForce.apply`) and tell the kit."""
        self._in_force.apply(plan, pl_module, self.overrides)
        self._record_facts()

    def _record_facts(self) -> None:
        """Tell the kit what runs in which dtype, what was measured, and why a class stays in fp32."""
        if self._facts is not None:
            record_facts(self._facts, self.table, self.decisions, self.measurements,
                         ("PrecisionPolicy(rules='auto')" if self.auto else "PrecisionPolicy's speed check") +
                         f" at step {self._schedule.measured_at}", self._auto.fp8 if self.auto else None,
                         self._governor.autocast)

    # the decision kept across a resume

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._in_force.state(self.overrides) if self.auto and not self._auto.trialing else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._schedule.restored = Plan.from_state(state_dict["plan"], self.overrides) if "plan" in state_dict else None

    def decision_as_arguments(self) -> str | None:
        """With ``rules="auto"``, once decided: the arguments that run this decision in the next run unmeasured."""
        return self._in_force.as_arguments(self.fp8_recipe) if self.auto else None

    # batches: measure, trial, census

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        step = trainer.global_step
        start = self._steps.start(step, pl_module.device, self.loads_step(step),
                                  lambda: measuring_besides(trainer, self), lambda: lowered(self.table))
        for plan in (start.trial, start.restore):  # a contender's table; a resumed fit runs its checkpoint's decision
            if plan is not None:
                self._apply(pl_module, plan)
        if start.restore is not None:
            self._log_table(step)
        if start.measure:
            self._measure_and_decide(trainer, pl_module, batch, batch_idx)
        self.fp8.gather.precompute_scales()  # after any measurement or plan: the weights the step gathers

    def _measure_and_decide(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                            batch_idx: int) -> None:
        grad_scaler = getattr(trainer.precision_plugin, "scaler", None)
        compiled = any(offering(trainer, CompilesRegions))
        modules, note = auto_candidates(pl_module, self.fp8, self.overrides | self.pinned, self.try_fp8,
                                        pl_module.device)
        with self.fp8.plain(None):  # measured as written: the classes', and each Linear's, dtypes are being decided
            plan = self._auto.measure_and_decide(
                pl_module, batch, self._originals["training_step"], batch_idx,
                # the dtype the Trainer autocasts to (the two 16-bit dtypes cannot mix under autocast), else bf16
                dtypes=[AUTOCAST_DTYPE.get(str(trainer.precision), "bf16")],
                agree=lambda value: trainer.strategy.broadcast(value, src=0), compiled=compiled,
                accumulating=trainer.accumulate_grad_batches > 1,
                loss_scale=float(grad_scaler.get_scale()) if grad_scaler is not None else None,
                fp8=Fp8Ask(modules, self.fp8_recipe, note))
        self._apply(pl_module, plan)
        self._log_decision(trainer.global_step)
        if self.measurements is not None:
            self._scalars("opkit/precision", {"measure_s": self.measure_seconds}, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._steps.ends_idle:
            return  # most batches: nothing measured, trialled or counted (the hooks run with cold caches)
        step = trainer.global_step
        end = self._steps.end(pl_module.device, lambda value: trainer.strategy.broadcast(value, src=0), self.table)
        if end.plan is not None:
            self._apply(pl_module, end.plan)
            self._log_decision(step)
        if end.speed is not None:
            self._speed_measurements = end.speed
            self._record_facts()
            write_speed_check(self._writer, end.speed, self.table, step)
        if end.census is not None:
            self.census = merge_rows(end.census, lambda r: (r.op_class, r.dtype))
            write_census(self._writer, end.census, self.table, step)

    # what gets logged where (besides the census)

    def _log_table(self, step: int) -> None:
        if self._writer is not None:
            self._writer.text("opkit/precision/policy", policy_markdown(self.table, self.decisions, self.overrides,
                                                                        waiting=self.auto and not self.decisions)
                              + fp8_markdown(self.fp8), step)

    def _log_decision(self, step: int) -> None:
        if self._writer is None or self._auto.measurements is None:
            return
        self._writer.text("opkit/precision/sensitivity", self._auto.sensitivity_markdown(
            self._in_force.plan.dtypes if self._in_force.plan is not None else {}), step)
        again = f"\n\nTo run it again without measuring: `{self.decision_as_arguments()}`"
        self._writer.text("opkit/precision/decision", self._auto.decision_markdown(
            self.decisions, self._governor.aside()) + again, step)
        self._log_table(step)
        self._writer.flush()
