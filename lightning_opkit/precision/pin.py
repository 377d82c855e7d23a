"""A ``rules="auto"`` decision kept for later: in the checkpoint, and as the arguments that run it unmeasured.

A resumed fit runs the checkpoint's decision without measuring again; the next run can be given the explicit
arguments the summary prints instead of ``"auto"``, and measures nothing at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_opkit.precision.auto import Plan
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import GOVERNED

__all__ = ["pinned_arguments", "plan_from_state", "plan_state"]

_BEFORE = " (measured before the checkpoint)"


def plan_state(plan: Plan, fp8: dict[str, str] | None = None) -> dict[str, Any]:
    """``plan`` as checkpoint state (plain types).

    Args:
        plan: the plan the policy runs.
        fp8: the float8 modules that run now, where a repair reverted some of the plan's (``None``: the plan's).

    Example:
        >>> plan = Plan({"matmul": Decision("matmul", "bf16", "1.8x faster")}, fp8={"mlp.up": "1.4x faster than bf16"})
        >>> plan_state(plan)
        {'classes': {'matmul': ['bf16', '1.8x faster']}, 'autocast': None, 'fp8': {'mlp.up': '1.4x faster than bf16'}}
    """
    return {"classes": {c: [d.dtype, d.reason] for c, d in plan.classes.items()}, "autocast": plan.autocast,
            "fp8": dict(plan.fp8 if fp8 is None else fp8)}


def plan_from_state(state: dict[str, Any]) -> Plan:
    """The plan :func:`plan_state` wrote, its reasons marked as restored.

    Args:
        state: what :func:`plan_state` returned.

    Example:
        >>> plan = plan_from_state({"classes": {"matmul": ["bf16", "1.8x faster"]}, "autocast": None})
        >>> plan.classes
        {'matmul': Decision(op_class='matmul', dtype='bf16', reason='1.8x faster (measured before the checkpoint)')}
        >>> plan_from_state(plan_state(plan)) == plan
        True
    """
    def restored(why: str) -> str:  # a plan resumed twice was still measured once
        return why if why.endswith(_BEFORE) else why + _BEFORE

    classes = {c: Decision(c, d, restored(why)) for c, (d, why) in state["classes"].items()}
    # a checkpoint written before float8 was measured has no "fp8"
    return Plan(classes, state.get("autocast"), {n: restored(why) for n, why in state.get("fp8", {}).items()})


def pinned_arguments(table: dict[str, str], autocast: str | None, fp8: Sequence[str] = (),
                     recipe: str = "tensorwise") -> str:
    """How to run this decision in the next run without measuring: the arguments to write instead of ``"auto"``.

    Args:
        table: op class -> dtype name, as decided.
        autocast: plain autocast's dtype, when that is what won.
        fp8: the modules measured faster in float8 (module overrides then say ``"fp8"``).
        recipe: their float8 recipe.

    Example:
        >>> pinned_arguments({c: "fp32" for c in GOVERNED} | {"matmul": "bf16"}, None)[:56]
        "PrecisionPolicy(rules={'matmul': 'bf16', 'conv': 'fp32',"
        >>> pinned_arguments({}, "bf16")
        "Trainer(precision='bf16-mixed') without a PrecisionPolicy (plain autocast won)"
        >>> pinned_arguments({}, "bf16", ["mlp.up"])[-44:]
        "'rnn': 'keep'}, overrides={'mlp.up': 'fp8'})"
    """
    overrides = dict.fromkeys(fp8, "fp8")
    extra = (f", overrides={overrides!r}" if overrides else "") + (
        f", fp8_recipe={recipe!r}" if overrides and recipe != "tensorwise" else "")
    if autocast is not None:
        if overrides:  # the policy only for the float8 GEMMs: autocast decides every class
            return (f"Trainer(precision='{autocast}-mixed') with PrecisionPolicy(rules="
                    f"{dict.fromkeys(GOVERNED, 'keep')!r}{extra})")
        return f"Trainer(precision='{autocast}-mixed') without a PrecisionPolicy (plain autocast won)"
    rules = {c: table[c] for c in GOVERNED if c in table}
    return f"PrecisionPolicy(rules={rules!r}{extra})"
