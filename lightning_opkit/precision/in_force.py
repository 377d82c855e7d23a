"""What PrecisionPolicy runs now, Trainer-free: the class table, the plan it came from, module overrides and pins.

:class:`DecisionInForce` is the one place the table in force changes (a fit's starting table, a plan applied) and the
one the reports read it from: the TensorBoard table, the summary, the kit's facts, the checkpoint and
``decision_as_arguments()``. It installs the decision on the model (module overrides, float8 modules, pins) and takes
it off again. Applying a :class:`~.plan.Plan` sets the governor's table, plain autocast and float8's modules together,
so no report can show one and the step run another.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_opkit.core.patch import Patches
from lightning_opkit.core.select import match_rule
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import DTYPES, FP8, GOVERNED
from lightning_opkit.precision.fp8 import Float8Linears
from lightning_opkit.precision.function_mode import hold_rnn_input_casts
from lightning_opkit.precision.governor import StepGovernor
from lightning_opkit.precision.plan import Plan, labelled_overrides, pinned_arguments

__all__ = ["DecisionInForce"]


class DecisionInForce:
    """The class table the steps run, the ``rules="auto"`` plan it came from (if any), and its float8 modules.

    Args:
        table: the starting table (op class -> dtype name).
        governor: what runs each step in the table (its table and plain autocast are set from here).
        fp8: the float8 modules (a plan picks those that run in float8).

    Example:
        >>> from lightning_opkit.precision.config import initial_table
        >>> table = initial_table(None, "keep")
        >>> governor = StepGovernor(table)
        >>> now = DecisionInForce(table, governor, Float8Linears("tensorwise", census=governor.census))
        >>> plan = Plan({"matmul": Decision("matmul", "fp32", "not faster")})
        >>> now.apply(plan, torch.nn.Linear(2, 2), {})
        >>> now.table["matmul"], now.table["norm"], now.decisions["matmul"].reason, now.as_arguments("tensorwise")[:43]
        ('fp32', 'fp32', 'not faster', "PrecisionPolicy(rules={'matmul': 'fp32', 'c")
    """

    def __init__(self, table: dict[str, str], governor: StepGovernor, fp8: Float8Linears) -> None:
        self.table = table
        #: the ``rules="auto"`` plan applied last (``None``: none yet)
        self.plan: Plan | None = None
        #: modules pinned at run time (:meth:`pin`, a NaN repair) -> dtype name
        self.pinned: dict[str, str] = {}
        self._governor, self._fp8 = governor, fp8

    def start(self, table: dict[str, str]) -> None:
        """A fit's starting table (the rules as the Trainer's precision and device allow them)."""
        self.table = table
        self._governor.set_table(table)

    def install(self, patches: Patches, model: torch.nn.Module, matched: list[tuple[str, torch.nn.Module]],
                overrides: dict[str, str], device: torch.device, auto: bool) -> None:
        """Hold the module overrides and float8 modules on ``model`` while ``patches`` hold; steps run the table.

        Args:
            patches: undone at teardown (the overrides' hooks).
            model: the model.
            matched: the modules the overrides' globs matched, with their paths.
            overrides: module glob -> dtype name.
            device: where the fit runs (float8 needs its GEMM units).
            auto: ``rules="auto"``: nothing is expressed as autocast before a decision.
        """
        hold_rnn_input_casts(patches, model)
        for name, module in matched:
            rule = match_rule(name, overrides)
            # an fp8 override is about its Linears' GEMMs: its other ops run as their class rules say
            self._governor.hold_override(patches, module, None if rule == FP8 else DTYPES[rule])  # type: ignore[index]
        self._fp8.start(model, self.table, overrides, device)
        self._governor.passthrough, self._governor.autocast = False, None
        self._governor.express({} if auto else self.table, model, bool(matched or self._fp8.converted))

    def pin(self, patches: Patches, name: str, module: torch.nn.Module, dtype: str) -> None:
        """From now on every op inside ``module`` runs in ``dtype`` (its float8 GEMMs too), while ``patches`` hold."""
        for converted in self._fp8.inside(module):
            self._fp8.revert(converted)  # a float8 GEMM pinned back to the dtype asked
        self._governor.hold_override(patches, module, DTYPES[dtype])
        self._governor.pinned = True
        self.pinned[name] = dtype

    def release(self) -> None:
        """Take the float8 modules and pins off (the patches, undone by their holder, took the overrides' hooks)."""
        self._fp8.restore()
        self.pinned.clear()
        self._governor.pinned = False
        self._governor.clear()

    def apply(self, plan: Plan, model: torch.nn.Module, overrides: dict[str, str]) -> None:
        """Run ``plan`` from now on: its classes' dtypes (or plain autocast) and its float8 modules.

        Args:
            plan: the decision.
            model: the model it runs on, on its device (plain autocast's).
            overrides: the module overrides in force (they keep their dtype over the plan's classes).
        """
        governor = self._governor
        self.plan = plan
        governor.autocast = plan.autocast
        self._fp8.choose(plan.fp8, model, overrides)
        # Classes the model was not seen to run: fp32, or under plain autocast whatever autocast does with them.
        table = {**self.table, **dict.fromkeys(GOVERNED, "fp32" if plan.autocast is None else "keep"), **plan.dtypes}
        self.table = table
        governor.set_table(table)
        governor.settle(table, plan.dtypes, model, bool(overrides), bool(self._fp8.converted))

    @property
    def decisions(self) -> dict[str, Decision]:
        """Op class -> the plan's decision and its evidence (empty before a plan)."""
        return dict(self.plan.classes) if self.plan is not None else {}

    def labelled_overrides(self, overrides: dict[str, str]) -> dict[str, str]:
        """The summary's module overrides: the globs, the pins, those added after a resumed plan, each named."""
        return labelled_overrides(overrides, self.pinned, self.plan)

    def state(self, overrides: dict[str, str]) -> dict[str, Any]:
        """The plan as checkpoint state, with the float8 modules as they run (a repair's reverts left out)."""
        return {"plan": self.plan.state(self._fp8.by_auto, overrides)} if self.plan is not None else {}

    def as_arguments(self, recipe: str) -> str | None:
        """The arguments that run the plan in the next run without measuring (``None`` before a plan)."""
        if self.plan is None:
            return None
        return pinned_arguments(self.table, self.plan.autocast, list(self._fp8.by_auto), recipe)
